"""DistTrainer under DeepSpeed ZeRO-2 and ZeRO-3 on 2 gloo ranks: ``save_steps`` writes the engine's own
checkpoints, and a run resumed from ``checkpoint-3`` continues the uninterrupted one exactly (losses after the
resume point and final parameters; CPU fp32).

hf_dist does not write these checkpoints (the Trainer / accelerate / the DeepSpeed engine do); what this checks
is that DistTrainer's resume path — data position, RNG, optimizer and scheduler restored by the Trainer — is exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import SAVE_EVERY, STEPS, _step_counter, _stop_after
from trainer_harness import VOCAB, token_dataset

SAME = dict(atol=1e-6, rtol=0)


REPO = Path(__file__).resolve().parents[1]


def _as_accelerate_launch(stage: int) -> None:
    """The environment ``accelerate launch --config_file accelerate_configs/zero{stage}.yaml`` gives each rank.

    (``TrainingArguments(deepspeed=...)`` on CPU does not reach the gloo group accelerate needs: the Trainer
    builds accelerate's state without a backend, and DistTrainer refuses the run as "sees 1 process".)
    """
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_MIXED_PRECISION="no",
                      ACCELERATE_DEEPSPEED_CONFIG_FILE=str(REPO / "ds_configs" / f"zero{stage}.json"),
                      ACCELERATE_DEEPSPEED_ZERO3_INIT="false")


def _run(output_dir: str, *, stage: int, resume: bool, stop_after: int | None = None) -> dict:
    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model

    _as_accelerate_launch(stage)
    args = DistTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="steps",
        save_steps=SAVE_EVERY, report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
        max_grad_norm=1.0,
    )
    model = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    counter = _step_counter()
    callbacks = [counter] + ([_stop_after(stop_after)] if stop_after else [])
    trainer = DistTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume or None)
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    return {"losses": losses, "params": _gathered_params(trainer), "steps_run": counter.steps_run}


def _gathered_params(trainer) -> dict:
    import deepspeed

    module = trainer.model_wrapped.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):  # no-op under ZeRO-2
        return {name: p.detach().clone().numpy() for name, p in module.named_parameters()}


def _uninterrupted_then_resumed(rank, world, root, stages):
    out = {}
    for stage in stages:
        full = _run(f"{root}/zero{stage}/full", stage=stage, resume=False)
        _run(f"{root}/zero{stage}/cut", stage=stage, resume=False, stop_after=SAVE_EVERY + 1)
        out[stage] = {"full": full, "resumed": _run(f"{root}/zero{stage}/cut", stage=stage, resume=True)}
    return out


STAGES = (2, 3)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    return root, run_distributed(_uninterrupted_then_resumed, 2, str(root), STAGES)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_trainer_resume_matches_uninterrupted(zero_runs, stage):
    root, result = zero_runs
    full, resumed = result[stage]["full"], result[stage]["resumed"]
    assert (root / f"zero{stage}" / "cut" / f"checkpoint-{SAVE_EVERY}" / f"global_step{SAVE_EVERY}").is_dir()
    assert resumed["steps_run"] == STEPS - SAVE_EVERY  # it resumed from checkpoint-3 (the Trainer's newest)
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], **SAME)
    torch.testing.assert_close({k: torch.as_tensor(v) for k, v in resumed["params"].items()},
                               {k: torch.as_tensor(v) for k, v in full["params"].items()}, **SAME)

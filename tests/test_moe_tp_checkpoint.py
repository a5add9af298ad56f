"""DistTrainer ``tp_size=2`` on MoE types whose experts fuse ``[gate | up]`` (qwen3_moe, mixtral, deepseek_v3), with
the Trainer's default ``save_strategy="steps"``: each rank holds ``[gate_r | up_r]``, two blocks of the fused tensor,
written and read block by block (``hf_dist/checkpoint/blocks.py``).

One 2-rank spawn runs, per type (loaded from disk; router aux loss on, coefficient 0.1, where the type has one): 4
steps saving every step and the final ``save_model``; then a new run resumed from ``checkpoint-2``. In this process:
the same 4 steps in one process (the reference), the TP=2 ``checkpoint-2`` resumed in one process (plain model), and
``checkpoint-4`` exported to the Hub format. Resumed losses and parameters equal the uninterrupted run (1e-6 on the
same layout, 1e-5 in one process); both equal one process within 1e-5; the final save and the export load with
``from_pretrained`` to the trained parameters exactly.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import _step_counter
from torch.testing import assert_close
from trainer_harness import VOCAB, as_loaded, full_parameters, token_dataset

CASES = ("qwen3_moe", "mixtral", "deepseek_v3")
STEPS, RESUME_AT, AUX, MAX_NORM = 4, 2, 0.1, 0.5


def _model(name: str):
    from ep_cases import moe_config

    from hf_dist.models.tiny import build_tiny_model

    config = moe_config(name, aux=AUX)
    config.vocab_size = VOCAB
    return as_loaded(build_tiny_model(config, seed=0))


def _train(name: str, output_dir: str, *, tp: int, resume: str | None = None, final: str | None = None) -> dict:
    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(  # save_strategy left at the Trainer's default ("steps")
        output_dir=output_dir, max_steps=STEPS, save_steps=1, per_device_train_batch_size=4, global_batch_size=8,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1, report_to=[], seed=0, data_seed=0,
        disable_tqdm=True, logging_steps=1, dataloader_num_workers=0, max_grad_norm=MAX_NORM, use_cpu=tp == 1,
        **({"tp_size": tp} if tp > 1 else {}),
    )
    assert args.save_strategy == "steps"
    counter = _step_counter()
    trainer = DistTrainer(model=_model(name), args=args, train_dataset=token_dataset(), callbacks=[counter])
    assert trainer.dims.tp == tp
    trainer.train(resume_from_checkpoint=resume)
    if final is not None:
        trainer.save_model(final)
    logs = trainer.state.log_history
    return {"losses": {log["step"]: log["loss"] for log in logs if "loss" in log},
            "norms": {log["step"]: log["grad_norm"] for log in logs if "grad_norm" in log},
            "steps_run": counter.steps_run,
            "params": {k: v.detach().clone() for k, v in full_parameters(trainer).items()}}


def _two_ranks(rank, world, root):
    out = {}
    for name in CASES:
        full = _train(name, f"{root}/{name}/full", tp=2, final=f"{root}/{name}/final")
        resumed = _train(name, f"{root}/{name}/resumed", tp=2, resume=f"{root}/{name}/full/checkpoint-{RESUME_AT}")
        out[name] = {"full": full, "resumed": resumed}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp_ckpt")
    return root, run_distributed(_two_ranks, 2, str(root))


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert_close(value, b[key], atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


def _losses_after_resume(run: dict, full: dict, atol: float) -> None:
    assert run["steps_run"] == STEPS - RESUME_AT
    for step in range(RESUME_AT + 1, STEPS + 1):
        assert_close(run["losses"][step], full["losses"][step], atol=atol, rtol=0, msg=f"step {step}")


@pytest.mark.parametrize("name", CASES)
def test_tp2_checkpoint_of_split_gate_up_resumes_exactly_and_equals_one_process(runs, name, tmp_path):
    from hf_dist.checkpoint import read_manifest

    root, ranks = runs
    assert read_manifest(root / name / "full" / f"checkpoint-{RESUME_AT}").layout["tp"] == 2
    reference = _train(name, str(tmp_path / "one"), tp=1)
    assert min(reference["norms"].values()) > MAX_NORM  # clipping active on every step
    for rank, result in enumerate(ranks):
        full, resumed = result[name]["full"], result[name]["resumed"]
        _losses_after_resume(resumed, full, 1e-6)
        _close(resumed["params"], full["params"], 1e-6)
        assert_close(torch.tensor(list(full["losses"].values())), torch.tensor(list(reference["losses"].values())),
                     atol=1e-5, rtol=0, msg=f"rank {rank}")
        _close(full["params"], reference["params"], 1e-5)


@pytest.mark.parametrize("name", CASES)
def test_tp2_checkpoint_resumes_in_one_process(runs, name, tmp_path):
    """TP=2 -> one process (plain model): the fused tensor is read from both ranks' blocks."""
    root, ranks = runs
    resumed = _train(name, str(tmp_path / "one"), tp=1, resume=str(root / name / "full" / f"checkpoint-{RESUME_AT}"))
    full = ranks[0][name]["full"]
    _losses_after_resume(resumed, full, 1e-5)
    _close(resumed["params"], full["params"], 1e-5)


@pytest.mark.parametrize("name", CASES)
def test_final_save_and_export_load_with_from_pretrained_to_the_trained_weights(runs, name, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_dist.checkpoint.export import export_checkpoint

    root, ranks = runs
    trained = ranks[0][name]["full"]["params"]
    report = export_checkpoint(root / name / "full" / f"checkpoint-{STEPS}", tmp_path / "export")
    assert report.verification == "tensors" and report.tensors_verified
    for folder in (root / name / "final", tmp_path / "export"):
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
        _close(loaded, trained, 0)

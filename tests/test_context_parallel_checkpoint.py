"""DistTrainer with ``cp_size=2`` x FSDP2 on 2 gloo ranks saves hf_dist checkpoints that resume exactly, on the same
layout and in one process (the cp ranks share one batch, so one process reads the same global batch).

The model is loaded from disk as a user's is (eval mode until the Trainer's first step), and the uninterrupted CP run
equals one process from its first step: the first step of a ``train()`` call and of a resumed run are both compared."""

from __future__ import annotations

import shutil

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import _step_counter, _stop_after
from trainer_harness import VOCAB, as_loaded, full_parameters, token_dataset

STEPS, SAVE_EVERY = 6, 3
LAYOUTS = {"cp_fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}, cp_size=2), "one process": {}}


def _run(output_dir: str, *, layout: str, resume: bool | str, stop_after: int | None = None):
    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models import build_tiny_model

    args = DistTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_strategy="steps",
        save_steps=SAVE_EVERY, save_total_limit=1, report_to=[], seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0, max_grad_norm=0.5, use_cpu=layout == "one process", **LAYOUTS[layout],
    )
    counter = _step_counter()
    callbacks = [counter] + ([_stop_after(stop_after)] if stop_after else [])
    model = as_loaded(build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2))
    trainer = DistTrainer(model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    assert trainer.dims.cp == (2 if layout == "cp_fsdp2" else 1)
    trainer.train(resume_from_checkpoint=resume or None)
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    norms = {log["step"]: log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log}
    params = {k: v.numpy() for k, v in full_parameters(trainer).items()}
    return {"losses": losses, "norms": norms, "params": params, "steps_run": counter.steps_run}


def _two_ranks(rank, world, root):
    full = _run(f"{root}/full", layout="cp_fsdp2", resume=False)
    _run(f"{root}/cut", layout="cp_fsdp2", resume=False, stop_after=SAVE_EVERY + 1)
    if rank == 0:  # kept for the one-process resume (retention deletes it after step 6)
        shutil.copytree(f"{root}/cut/checkpoint-{SAVE_EVERY}", f"{root}/kept")
    torch.distributed.barrier()
    return {"full": full, "resumed": _run(f"{root}/cut", layout="cp_fsdp2", resume=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_checkpoint")
    return root, run_distributed(_two_ranks, 2, str(root))[0]


def _close(a: dict, b: dict, atol: float) -> None:
    torch.testing.assert_close({k: torch.as_tensor(v) for k, v in a.items()},
                               {k: torch.as_tensor(v) for k, v in b.items()}, atol=atol, rtol=0)


def test_cp_checkpoint_resumes_exactly(runs):
    from hf_dist.checkpoint import read_manifest

    root, result = runs
    assert "cp2" in read_manifest(root / "full" / "checkpoint-6").layout["name"]
    full, resumed = result["full"], result["resumed"]
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    assert min(full["norms"].values()) > 0.5  # clipping active on every step
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-6, rtol=0)
    _close(resumed["params"], full["params"], 1e-6)


def test_cp_run_equals_one_process_from_its_first_step(runs, tmp_path):
    _, result = runs
    one = _run(str(tmp_path / "one"), layout="one process", resume=False)
    full = result["full"]
    assert sorted(full["losses"]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        torch.testing.assert_close(full["losses"][step], one["losses"][step], atol=1e-5, rtol=0)
    _close(full["params"], one["params"], 1e-5)


def test_cp_checkpoint_resumes_in_one_process(runs, tmp_path):
    root, result = runs
    resumed = _run(str(tmp_path / "one"), layout="one process", resume=str(root / "kept"))
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    full = result["full"]
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        torch.testing.assert_close(resumed["losses"][step], full["losses"][step], atol=1e-5, rtol=0)
    _close(resumed["params"], full["params"], 1e-5)

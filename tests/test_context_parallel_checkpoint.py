"""DistTrainer with ``cp_size=2`` x FSDP2 on 2 gloo ranks saves hf_dist checkpoints that resume exactly, on the same
layout and in one process (the cp ranks share one batch, so one process reads the same global batch).

The model is loaded from disk as a user's is (eval mode until the Trainer's first step), and the CP run equals one
process from its first step: the first optimizer step of a ``train()`` call and of a resumed run are compared
gradient by gradient (``trainer_harness.trainer_run``, ``parity.assert_parity``), and so are the losses and the
final parameters."""

from __future__ import annotations

import shutil

import pytest
import torch
from dist_utils import run_distributed
from parity import assert_parity
from test_checkpoint_trainer import _step_counter, _stop_after
from trainer_harness import trainer_run

STEPS, SAVE_EVERY = 6, 3
LAYOUTS = {"cp_fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}, cp_size=2), "one process": {}}


def _run(output_dir: str, *, layout: str, resume: bool | str | None = None, stop_after: int | None = None) -> dict:
    counter = _step_counter()
    callbacks = [counter] + ([_stop_after(stop_after)] if stop_after else [])
    run, trainer = trainer_run(
        output_dir, resume=resume, callbacks=callbacks, max_steps=STEPS, global_batch_size=4,
        lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=SAVE_EVERY, save_total_limit=1,
        max_grad_norm=0.5, use_cpu=layout == "one process", **LAYOUTS[layout])
    assert trainer.dims.cp == (2 if layout == "cp_fsdp2" else 1)
    logs = trainer.state.log_history
    return {**run, "steps": [log["step"] for log in logs if "loss" in log][-len(run["losses"]):],
            "norms": [log["grad_norm"] for log in logs if "grad_norm" in log], "steps_run": counter.steps_run}


def _two_ranks(rank, world, root):
    full = _run(f"{root}/full", layout="cp_fsdp2")
    _run(f"{root}/cut", layout="cp_fsdp2", stop_after=SAVE_EVERY + 1)
    if rank == 0:  # kept for the one-process resume (retention deletes it after step 6)
        shutil.copytree(f"{root}/cut/checkpoint-{SAVE_EVERY}", f"{root}/kept")
    torch.distributed.barrier()
    return {"full": full, "resumed": _run(f"{root}/cut", layout="cp_fsdp2", resume=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_checkpoint")
    return root, run_distributed(_two_ranks, 2, str(root))[0]


@pytest.fixture(scope="module")
def one_process(runs, tmp_path_factory):
    """One process: uninterrupted, and resumed from the CP run's checkpoint of step 3."""
    root, _ = runs
    out = tmp_path_factory.mktemp("cp_checkpoint_one")
    return {"full": _run(str(out / "full"), layout="one process"),
            "resumed": _run(str(out / "resumed"), layout="one process", resume=str(root / "kept"))}


def test_cp_checkpoint_resumes_exactly(runs):
    from hf_dist.checkpoint import read_manifest

    root, result = runs
    assert "cp2" in read_manifest(root / "full" / "checkpoint-6").layout["name"]
    full, resumed = result["full"], result["resumed"]
    assert resumed["steps_run"] == STEPS - SAVE_EVERY and resumed["steps"] == list(range(SAVE_EVERY + 1, STEPS + 1))
    assert min(full["norms"]) > 0.5  # clipping active on every step
    same = {**full, "losses": full["losses"][SAVE_EVERY:]}
    assert_parity({k: resumed[k] for k in ("losses", "state")}, same, atol=1e-6, what="CP resumed vs uninterrupted")


def test_cp_run_equals_one_process_from_its_first_step(runs, one_process):
    _, result = runs
    assert result["full"]["steps"] == list(range(1, STEPS + 1))
    assert_parity(result["full"], one_process["full"], what="CP vs one process, first step of train()")


def test_cp_resumed_run_equals_one_process_from_its_first_step(runs, one_process):
    """The resumed CP run's first step (step 4) against one process resumed from the same checkpoint; and that
    one-process resume continues the uninterrupted CP run."""
    _, result = runs
    resumed = one_process["resumed"]
    assert resumed["steps_run"] == STEPS - SAVE_EVERY
    assert_parity(result["resumed"], resumed, what="CP vs one process, first step of a resumed run")
    full = result["full"]
    assert_parity({k: resumed[k] for k in ("losses", "state")}, {**full, "losses": full["losses"][SAVE_EVERY:]},
                  what="one process resumed from CP vs uninterrupted CP")

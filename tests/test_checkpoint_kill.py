"""Kill tests: SIGKILL one rank mid-training, another mid-save; the restart resumes from the last complete
checkpoint and ends equal to the uninterrupted run (FSDP2, 2 gloo ranks).

A rank kills itself with SIGKILL at a chosen point (no clean-up runs); the surviving rank blocks in its next
collective and is killed by the test, as a launcher would do.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import torch
from dist_utils import _worker, free_port, run_distributed
from test_checkpoint_loop import as_tensors, picklable, train

from hf_dist.checkpoint import manifest as mf

STEPS, SAVE_AT = 6, (2, 4)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _faulty_run(rank, world, root, fault):
    if fault == "train" and rank == 1:
        train("fsdp", steps=STEPS, save_at=SAVE_AT, root=root, on_step=lambda step: step == 5 and _die())
    if fault == "save" and rank == 0:
        real = mf.write_text_durably

        def killed_while_committing(path, text):
            if path.name == mf.MANIFEST_NAME and ".step_4.partial" in str(path):
                _die()  # the shards of step 4 are on disk, its manifest is not
            real(path, text)

        mf.write_text_durably = killed_while_committing
    train("fsdp", steps=STEPS, save_at=SAVE_AT, root=root)
    return "finished"


def _run_until_a_rank_dies(root: str, fault: str, timeout_s: float = 240) -> list[int]:
    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, _faulty_run, (root, fault), queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(p.exitcode not in (None, 0) for p in procs):
        time.sleep(0.1)
    for proc in procs:  # the survivor is stuck in a collective with a dead peer
        if proc.is_alive():
            proc.kill()
        proc.join()
    return [proc.exitcode for proc in procs]


def _resume_both(rank, world, root):
    full = train("fsdp", steps=STEPS)
    return {
        "full": picklable(full),
        "train": picklable(train("fsdp", steps=STEPS, save_at=SAVE_AT, root=f"{root}/train", resume=f"{root}/train")),
        "save": picklable(train("fsdp", steps=STEPS, save_at=SAVE_AT, root=f"{root}/save", resume=f"{root}/save")),
    }


def test_killed_rank_and_killed_save_resume_to_the_same_result(tmp_path):
    codes = _run_until_a_rank_dies(str(tmp_path / "train"), "train")
    assert codes[1] == -signal.SIGKILL
    assert (tmp_path / "train" / "latest").read_text().strip() == "step_4"

    codes = _run_until_a_rank_dies(str(tmp_path / "save"), "save")
    assert codes[0] == -signal.SIGKILL
    assert (tmp_path / "save" / "latest").read_text().strip() == "step_2"  # step 4 never committed
    assert (tmp_path / "save" / ".step_4.partial").is_dir() and not (tmp_path / "save" / "step_4").exists()

    results = run_distributed(_resume_both, 2, str(tmp_path))
    full = results[0]["full"]
    for fault, resumed_at in (("train", 4), ("save", 2)):
        resumed = results[0][fault]
        assert len(resumed["losses"]) == STEPS - resumed_at  # resumed from the last complete checkpoint
        torch.testing.assert_close(resumed["losses"], full["losses"][resumed_at:], atol=1e-6, rtol=0)
        torch.testing.assert_close(as_tensors(resumed["params"]), as_tensors(full["params"]), atol=1e-6, rtol=0)
    assert mf.is_complete(tmp_path / "save" / "step_4")  # the restart's save replaced the partial one
    assert not (tmp_path / "save" / ".step_4.partial").exists()

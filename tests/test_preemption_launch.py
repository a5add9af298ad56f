"""End to end: the sbatch script's per-node task (`accelerate launch`, FSDP2, 2 ranks) gets SIGUSR1 on every
process of the step, as SLURM's `--signal=USR1@N` delivers it. The launcher ignores it, the ranks finish their
step, save, write preempted.json and stop; the same command again (RESUME=auto) finishes the run, and its losses
equal an uninterrupted run's (1e-6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from dist_utils import free_port
from launch_harness import ROOT, launch_env

SBATCH = ROOT / "examples" / "multinode" / "harbor_13b_2x8.sbatch"
TINY = [
    "--num_conversations", "96", "--max_seq_len", "48", "--eval_fraction", "0", "--per_device_train_batch_size", "2",
    "--global_batch_size", "8", "--max_steps", "10", "--logging_steps", "1", "--lr_scheduler_type", "linear",
    "--warmup_steps", "1", "--base_learning_rate", "2e-3", "--base_batch_size", "8",
]


def _node_task(out: Path) -> subprocess.Popen:
    env = dict(launch_env(), HARBOR_NODE_TASK="1", SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GPUS_PER_NODE="2",
               CONFIG="accelerate_configs/fsdp.yaml", PRESET="tiny", REPO=str(ROOT))
    log = open(out.with_suffix(".log"), "a")
    return subprocess.Popen(["bash", str(SBATCH), *TINY, "--output_dir", str(out)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)  # its own group, as a step


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc): the processes of a SLURM step's cgroup."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def _losses(out: Path) -> dict[int, float]:
    path = out / "log_history.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _finish(proc: subprocess.Popen, out: Path) -> int:
    code = proc.wait(timeout=900)  # a hang guard, not a timing
    assert code is not None, out.with_suffix(".log").read_text()[-4000:]
    return code


def test_sbatch_task_preempted_by_usr1_then_requeued_equals_uninterrupted(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _finish(_node_task(full), full) == 0
    proc = _node_task(cut)
    while not _losses(cut) and proc.poll() is None:  # training has begun: the ranks' handlers are installed
        time.sleep(0.2)
    for pid in _tree(proc.pid):  # every process of the "step" (launcher and both ranks), as cgroup tracking does
        os.kill(pid, signal.SIGUSR1)
    code = _finish(proc, cut)
    log = cut.with_suffix(".log").read_text()
    marker = json.loads((cut / "preempted.json").read_text())
    assert code != 0 and marker["signal"] == "SIGUSR1" and marker["exit_code"] == 75, log[-4000:]
    step = marker["step"]
    assert 1 <= step < 10 and (cut / marker["checkpoint"] / "COMPLETE").is_file()
    assert max(_losses(cut)) == step  # every rank stopped after the same step
    assert _finish(_node_task(cut), cut) == 0, cut.with_suffix(".log").read_text()[-4000:]  # the requeued job
    assert not (cut / "preempted.json").exists()
    resumed, reference = _losses(cut), _losses(full)
    assert sorted(resumed) == list(range(1, 11))
    for s in range(step + 1, 11):
        torch.testing.assert_close(resumed[s], reference[s], atol=1e-6, rtol=0)

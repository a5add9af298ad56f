"""Elastic restarts under `torchrun --nnodes 1:2 --max-restarts 3` with c10d rendezvous on localhost
(examples/multinode/elastic.sh, two agents of one process each, the Harbor recipe saving every step).

- shrink (FSDP2 and DDP): agent B is killed (SIGKILL, agent and rank) mid-run; agent A restarts its rank in a
  world of 1, which loads the newest complete checkpoint (saved by 2 ranks; FSDP2's resharded by DCP, DDP's the
  Trainer's own, full on every rank), re-derives the accumulation (2 -> 4) for the same global batch and
  finishes; its losses after the resume step equal a one-process run resumed from a copy of that checkpoint.
- grow (DDP and FSDP2): A trains alone; B joins; A's agent restarts its rank (which saves on the SIGTERM) and
  both resume in a world of 2 from the newest checkpoint; losses after it equal a 2-process run resumed from
  its copy (1e-5).

Both also check the samples (tests/elastic_train.py records the ids each rank trained on at each optimizer step):
every step's global batch is 8 samples, made of 8 / (2 x world) micro-batches of 2 per rank (the accumulation
re-derived for the world that trained it); each epoch of the run as the final model saw it (each step as trained
by the last world that trained it) holds every sample exactly once; the steps after the restart read exactly what
the reference read at those steps, rank by rank; and a step trained again after the restart had the same samples
as when the lost world trained it.

These are the slowest tests here (several launches and rendezvous rounds).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import free_port
from launch_harness import ROOT, launch_env
from test_preemption_launch import _tree

ELASTIC = ROOT / "examples" / "multinode" / "elastic.sh"
RECORDING = ROOT / "tests" / "elastic_train.py"  # the recipe, recording sample ids
GLOBAL_BATCH, MICRO = 8, 2
TINY = [  # 72 conversations keep 56 trainable at 48 tokens: 7 steps an epoch, no round padded
    "--preset", "tiny", "--num_conversations", "72", "--max_seq_len", "48", "--eval_fraction", "0",
    "--per_device_train_batch_size", "2", "--global_batch_size", "8", "--max_steps", "8", "--logging_steps", "1",
    "--lr_scheduler_type", "linear", "--warmup_steps", "1", "--base_learning_rate", "2e-3", "--base_batch_size", "8",
    "--save_strategy", "steps", "--save_steps", "1",
]
SHRINK_STEPS = 60  # as test_grow: 8 steps took 0.64 s, a loaded machine finished them before the kill landed
RESUMED = re.compile(r"resuming from (\S+) with world size (\d+)")


def _agent(out: Path, port: int, name: str, layout: list[str]) -> subprocess.Popen:
    env = dict(launch_env(), RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID=f"test-{port}", LAST_CALL="3",
               TRAIN_SCRIPT=str(RECORDING))
    log = open(out.parent / f"{name}.log", "w")
    return subprocess.Popen(["bash", str(ELASTIC), *TINY, *layout, "--output_dir", str(out)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def _latest_step(out: Path) -> int:
    latest = out / "latest"
    if latest.is_file():
        return int(latest.read_text().strip().split("-")[-1])
    steps = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(steps, default=0)


def _wait(condition, proc: subprocess.Popen, what: str, limit_s: float = 900) -> None:
    deadline = time.monotonic() + limit_s  # a hang guard, not a timing
    while not condition():
        assert proc.poll() is None, f"agent ended before {what}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.5)


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "log_history.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _resumed_from(log: str, world: int) -> Path:
    hits = [(Path(p), int(w)) for p, w in RESUMED.findall(log)]
    assert hits and hits[-1][1] == world, log[-4000:]
    return hits[-1][0]


def _reference(tmp_path: Path, checkpoint: Path, processes: int, extra: list[str]) -> Path:
    ref = tmp_path / "reference"
    ref.mkdir()
    shutil.copytree(checkpoint, ref / checkpoint.name)
    if processes == 1:
        cmd = [sys.executable, str(RECORDING)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(RECORDING)]
    cmd += [*TINY, *extra, "--output_dir", str(ref), "--resume_from_checkpoint", str(ref / checkpoint.name)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ref


def _kill(proc: subprocess.Popen) -> None:
    for pid in _tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _check_continues(out: Path, tmp_path: Path, checkpoint: Path, worlds: tuple[int, int], steps: int,
                     extra: list[str]) -> None:
    """Losses and samples after the restart (world ``worlds[0]`` -> ``worlds[1]``) against the reference."""
    step = int(checkpoint.name.split("-")[1])
    assert 1 <= step < steps
    ref = _reference(tmp_path, checkpoint, worlds[1], extra)
    losses, reference = _losses(out), _losses(ref)
    assert sorted(losses) == list(range(1, steps + 1))  # no step lost or repeated in the log
    for s in range(step + 1, steps + 1):
        torch.testing.assert_close(losses[s], reference[s], atol=1e-5, rtol=0)
    _check_samples(out, ref, step, worlds, steps)


def _attempts(run: Path) -> dict[int, list[list[dict]]]:
    """Per step, the records of every start of the world that trained it (one record per rank), oldest first."""
    order: dict[str, int] = {}
    by_step: dict[int, dict[str, list[dict]]] = {}
    for record in map(json.loads, (run / "sample_ids.jsonl").read_text().splitlines()):
        order.setdefault(record["attempt"], len(order))
        by_step.setdefault(record["step"], {}).setdefault(record["attempt"], []).append(record)
    return {step: [sorted(found[a], key=lambda r: r["rank"]) for a in sorted(found, key=order.get)]
            for step, found in by_step.items()}


def _ids(records: list[dict]) -> list[int]:
    return [i for record in records for micro in record["micro"] for i in micro]


def _check_samples(out: Path, ref: Path | None, resumed_at: int, worlds: tuple[int, int], steps: int) -> None:
    """The sample ids of a run restarted after step ``resumed_at`` (and of ``ref``, a run of ``worlds[1]``)."""
    attempts = _attempts(out)
    # What the final model was trained on: each step as the last world that trained it trained it.
    trained = {step: found[-1] for step, found in attempts.items()}
    assert sorted(trained) == list(range(1, steps + 1)), sorted(trained)
    for step, records in trained.items():
        for lost in attempts[step][:-1]:  # a step trained again after the restart: the same samples
            complete = len(lost) == lost[0]["world"]  # a killed rank may not have written its line
            ok = set(_ids(lost)) == set(_ids(records)) if complete else set(_ids(lost)) <= set(_ids(records))
            assert ok, (step, lost, records)
        world = worlds[0] if step <= resumed_at else worlds[1]
        assert [(r["rank"], r["world"]) for r in records] == [(rank, world) for rank in range(world)], (step, records)
        assert {r["start"] for r in records} <= ({resumed_at} if step > resumed_at else set(range(resumed_at)))
        accumulation = GLOBAL_BATCH // (MICRO * world)  # the same global batch on any world
        for r in records:
            assert [len(micro) for micro in r["micro"]] == [MICRO] * accumulation, (step, r)
    if ref is not None:
        reference = {step: found[-1] for step, found in _attempts(ref).items()}
        for step in range(resumed_at + 1, steps + 1):  # rank by rank, micro-batch by micro-batch
            assert [r["micro"] for r in trained[step]] == [r["micro"] for r in reference[step]], step
    num_samples = trained[1][0]["num_samples"]
    assert num_samples % GLOBAL_BATCH == 0, num_samples  # else an epoch's last round is padded or short
    per_epoch = num_samples // GLOBAL_BATCH
    for first in range(1, steps + 1, per_epoch):
        epoch = [i for step in range(first, min(first + per_epoch, steps + 1)) for i in _ids(trained[step])]
        where = f"epoch of steps {first}..{first + per_epoch - 1} (restart after step {resumed_at})"
        assert len(set(epoch)) == len(epoch), f"{where}: samples repeated: {sorted(epoch)}"
        if len(epoch) == num_samples:
            assert sorted(epoch) == list(range(num_samples)), f"{where}: {sorted(epoch)}"


LAYOUTS = {"fsdp2": ["--fsdp2", "true"], "ddp": []}


def _saved_by(checkpoint: Path) -> int:
    """World size that wrote a checkpoint: hf_dist's manifest, or the Trainer's per-rank RNG files."""
    if (checkpoint / "manifest.json").is_file():
        return json.loads((checkpoint / "manifest.json").read_text())["world_size"]
    return max(1, len(list(checkpoint.glob("rng_state_*.pth"))))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shrink(tmp_path, layout):
    out, port = tmp_path / "run", free_port()
    # B must die while both train: at 8 steps a loaded machine reached the last step before the kill landed
    longer = ["--max_steps", str(SHRINK_STEPS), *LAYOUTS[layout]]
    a = _agent(out, port, "a", longer)
    time.sleep(2)  # A serves the rendezvous store
    b = _agent(out, port, "b", longer)
    try:
        _wait(lambda: _latest_step(out) >= 2, a, "checkpoint-2")
        _kill(b)
        assert a.wait(timeout=900) == 0, (tmp_path / "a.log").read_text()[-4000:]
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                _kill(proc)
    log = (tmp_path / "a.log").read_text()
    checkpoint = _resumed_from(log, world=1)
    assert _saved_by(checkpoint) == 2, log[-6000:]  # saved by 2 ranks, loaded by 1
    assert (checkpoint / "manifest.json").is_file() == (layout == "fsdp2")
    _check_continues(out, tmp_path, checkpoint, worlds=(2, 1), steps=SHRINK_STEPS, extra=longer[:2])  # 1 process


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grow(tmp_path, layout):
    out, port = tmp_path / "run", free_port()
    longer = ["--max_steps", "60", *LAYOUTS[layout]]  # B must join while A trains (its start-up takes ~10-30 s)
    a = _agent(out, port, "a", longer)
    b = None
    try:
        _wait(lambda: _latest_step(out) >= 1, a, "checkpoint-1")
        b = _agent(out, port, "b", longer)
        assert a.wait(timeout=900) == 0, (tmp_path / "a.log").read_text()[-4000:]
        assert b.wait(timeout=900) == 0, (tmp_path / "b.log").read_text()[-4000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                _kill(proc)
    checkpoint = _resumed_from((tmp_path / "a.log").read_text(), world=2)
    assert _saved_by(checkpoint) == 1
    _check_continues(out, tmp_path, checkpoint, worlds=(1, 2), steps=60, extra=longer)

"""hf-dist doctor: the straggler rule, the all-reduce probe on real gloo ranks, and the launcher end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port, run_distributed
from hf_dist.cli.doctor import parse_size
from hf_dist.doctor import ProbeResult, ProbeRow, bus_factor, collect_env, format_probe, run_probe, stragglers

ROOT = Path(__file__).resolve().parent.parent


def test_bus_factor_is_nccl_tests_allreduce_factor():
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    with pytest.raises(ValueError, match="world_size=0"):
        bus_factor(0)


def test_straggler_rule():
    assert stragglers([1.0, 1.0, 1.3]) == [2]
    assert stragglers([1.0, 1.19, 1.0, 1.1]) == []
    assert stragglers([2.0, 1.0, 1.0, 1.0, 3.0]) == [0, 4]


def test_parse_size():
    assert [parse_size(s) for s in ("4096", "64K", "16m", "1G", "2KB")] == [4096, 2**16, 2**24, 2**30, 2048]
    with pytest.raises(Exception, match="not a positive byte count"):
        parse_size("0K")


def _row(size: int, times: tuple[float, ...]) -> ProbeRow:
    mean = sum(times) / len(times)
    return ProbeRow(size_bytes=size, count=size // 4, dtype="float32", time_s=mean, algbw=size / mean,
                    busbw=size / mean * bus_factor(len(times)), rank_times_s=times)


def test_format_probe_warns_about_the_slow_rank():
    result = ProbeResult(backend="nccl", world_size=4, hosts=("a", "a", "b", "b"), correct=True,
                         rows=(_row(1024, (1e-5,) * 4), _row(2**20, (1e-3,) * 4)),
                         compute_times_s=(0.10, 0.10, 0.16, 0.11))
    text = format_probe(result)
    assert "WARNING: straggler rank 2 on b: local matmul 0.1600s > 1.2 x median 0.1050s" in text
    assert text.count("WARNING") == 1
    healthy = ProbeResult(**{**result.__dict__, "compute_times_s": (0.1, 0.1, 0.1, 0.1)})
    assert "no straggler" in format_probe(healthy)


def _probe(rank, world_size):
    import dataclasses

    return dataclasses.asdict(run_probe(sizes=(1024, 2**16), iters=2, warmup=1))


def test_probe_on_three_gloo_ranks():
    # three ranks, so that busbw/algbw = 2(n-1)/n = 4/3 is not the trivial 1 of two ranks
    results = run_distributed(_probe, 3)
    assert results[0] == results[1] == results[2]  # every rank holds the same gathered result
    result = results[0]
    assert (result["backend"], result["world_size"], result["correct"]) == ("gloo", 3, True)
    assert [row["size_bytes"] for row in result["rows"]] == [1024, 2**16]
    for row in result["rows"]:
        assert row["count"] * 4 == row["size_bytes"] and len(row["rank_times_s"]) == 3
        assert row["time_s"] == pytest.approx(sum(row["rank_times_s"]) / 3)
        assert row["algbw"] == pytest.approx(row["size_bytes"] / row["time_s"])
        assert row["busbw"] / row["algbw"] == pytest.approx(2 * (3 - 1) / 3)
    assert len(result["compute_times_s"]) == 3 and min(result["compute_times_s"]) > 0


def test_env_report_without_deepspeed():
    report = collect_env(with_deepspeed=False)
    assert report.backends["gloo"] is True and report.devices
    assert report.default_backend == ("nccl" if report.cuda_available and report.backends["nccl"] else "gloo")


def test_doctor_under_accelerate_launch_prints_the_bandwidth_table():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "hf_dist.cli", "doctor", "--sizes", "1K,64K,1M", "--iters", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "all-reduce probe: backend gloo, 2 ranks" in out
    header = next(line for line in out.splitlines() if "busbw(GB/s)" in line)
    rows = out.splitlines()[out.splitlines().index(header) + 1:][:3]
    assert [int(r.split()[0]) for r in rows] == [1024, 65536, 2**20]
    assert "result check (sum of rank+1): ok" in out
    assert "DeepSpeed ops (accelerator cpu" in out and "fused_adam" in out
    assert out.count("all-reduce probe:") == 1  # rank 0 prints, rank 1 does not

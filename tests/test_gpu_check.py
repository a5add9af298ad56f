"""``bench/gpu_check.py`` cannot rot while no GPU is at hand: its CPU smoke mode runs every section at toy sizes.

Single process, no wall-clock bound: every run trains, every section's rows are in the table and the markdown file,
no row failed, and the figures that exist on CPU are positive (the planner's forecasts, tokens/s, MFU).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(HERE, "..", "bench", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_runs_every_section_and_writes_the_table(tmp_path, capsys):
    gpu_check = _gpu_check()
    out = tmp_path / "gpu_check.md"
    assert gpu_check.main(["--cpu-smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("\n1. "):]
    written = out.read_text()
    for case in gpu_check.CASES.values():
        row = next(line for line in table.splitlines() if line.startswith(case["label"]))
        assert "FAILED" not in row
        cells = row[len(case["label"]):].split()
        step_ms, tokens_per_s, mfu = float(cells[0]), float(cells[1]), float(cells[2].rstrip("%"))
        assert step_ms > 0 and tokens_per_s > 0 and mfu > 0, row
        if case["model"] == "llama":  # the planner's allocated and reserved forecast, reserved >= allocated
            assert 0 < float(cells[-2]) <= float(cells[-1]), row
        if not case.get("plain"):  # DistTrainer's own MFU (dist_logging) is logged
            assert cells[3] != "-", row
        assert row in written
    for impl in ("eager", "batched_mm", "grouped_mm"):  # section 4: each within its bound against eager
        for precision in ("fp32", "bf16 autocast"):
            row = next(line for line in table.splitlines() if line.startswith(f"{impl} {precision}"))
            assert row.endswith("  yes") and row in written, row
    for section in ("\n2. ", "\n3. ", "\n4. ", "   assumed ", "   calibrated ", "   measured "):
        assert section in table and section in "\n" + written
    assert "CPU smoke run" in written


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_unless_asked_for_the_smoke_run(capsys):
    assert _gpu_check().main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--cpu-smoke" in err


def test_device_session_script_runs_the_check_and_leaves_its_files(tmp_path):
    """``bench/gpu_session.sh`` (the one command for a lent GPU machine) in smoke mode: versions, table and log land
    in ``$OUT`` and its exit status is the check's."""
    import subprocess

    import transformers

    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable,
               GPU_CHECK_ARGS="--cpu-smoke --no-calibrate --cases dist_chunked")
    done = subprocess.run(["bash", os.path.join(HERE, "..", "bench", "gpu_session.sh")], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"transformers {transformers.__version__}" in (out / "versions.txt").read_text()
    table = (out / "gpu_check.md").read_text()
    assert "CPU smoke run" in table and "FAILED" not in table
    assert "DistTrainer eager, chunked loss" in (out / "gpu_check.log").read_text()
    bad = dict(env, GPU_CHECK_ARGS="--cpu-smoke --cases no_such_case")  # the check's failure is the script's
    assert subprocess.run(["bash", os.path.join(HERE, "..", "bench", "gpu_session.sh")], env=bad,
                          capture_output=True, text=True).returncode != 0

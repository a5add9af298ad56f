"""The tiny Harbor twin end to end: the case study's parity check, and ``hf-dist report`` on a real run directory.

Parity (the check the case study used): validation perplexity after training under one process equals the
perplexity under each 2-process layout (DDP, FSDP2, DeepSpeed ZeRO-2) within 0.3%, with the same seed and global
batch. The runs go through ``examples/harbor/train.py`` as users run it, which evaluates *before* training too
(the path where DDP once silently stayed unwrapped). The report is drawn from the DDP run's directory, as
``make demo`` leaves it.
"""

import json
import sys
from pathlib import Path

import pytest

from hf_dist.cli import main as cli_main
from hf_dist.report import LOG_FILE, draw_report
from hf_dist.report.plot import PANEL_LOSS, PANEL_MEMORY, PANEL_STEP_TIME, PANEL_THROUGHPUT
from launch_harness import ROOT, TRAIN, launch_env

TINY = [
    "--preset", "tiny", "--num_conversations", "160", "--max_seq_len", "64", "--eval_fraction", "0.1",
    "--global_batch_size", "8", "--per_device_train_batch_size", "2", "--max_steps", "4", "--logging_steps", "1",
]
LAYOUTS = ("ddp", "fsdp", "zero2")
PARITY_RTOL = 0.003  # the case study's 0.3%


def _train(out: Path, *launcher: str) -> Path:
    import subprocess

    cmd = [*launcher, str(TRAIN), *TINY, "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = _train(tmp_path_factory.mktemp("single"), sys.executable)
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> dict[str, Path]:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    return {
        name: _train(tmp_path_factory.mktemp(name), *launch, str(ROOT / "accelerate_configs" / f"{name}.yaml"))
        for name in LAYOUTS
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_validation_perplexity_matches_one_process_within_0_3_percent(single, layout_runs, layout):
    summary = json.loads((layout_runs[layout] / "summary.json").read_text())
    assert summary["perplexity_before"] == pytest.approx(single["perplexity_before"], rel=1e-6)
    assert summary["perplexity_after"] < summary["perplexity_before"]  # it trained
    assert summary["perplexity_after"] == pytest.approx(single["perplexity_after"], rel=PARITY_RTOL)


def test_report_draws_the_four_panels_from_a_two_process_run(layout_runs, capsys):
    run_dir = layout_runs["ddp"]
    assert len([line for line in (run_dir / LOG_FILE).read_text().splitlines() if '"loss"' in line]) == 4
    assert cli_main(["report", str(run_dir)]) == 0
    assert "report.png" in capsys.readouterr().out
    out, panels = draw_report(run_dir, run_dir / "again.png")
    assert panels == [PANEL_LOSS, PANEL_THROUGHPUT, PANEL_MEMORY, PANEL_STEP_TIME]
    records = [json.loads(line) for line in (run_dir / LOG_FILE).read_text().splitlines()]
    assert all("peak_memory_gb/rank1" in r and "comm_wait_seconds" in r for r in records if "loss" in r)
    from PIL import Image

    for png in (run_dir / "report.png", out):
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (2000, 400)
            assert len(set(image.convert("L").get_flattened_data())) > 16  # curves and text, not a blank canvas


def test_report_falls_back_to_trainer_state(tmp_path):
    history = [{"loss": 3.0, "step": 1}, {"loss": 2.5, "step": 2}]
    (tmp_path / "checkpoint-2").mkdir()
    state = {"global_step": 2, "log_history": history}
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    _, panels = draw_report(tmp_path)
    assert panels == [PANEL_LOSS]


def test_report_refuses_a_dir_without_logs(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "log_history.jsonl" in capsys.readouterr().out
    with pytest.raises(ValueError, match="does not exist"):
        draw_report(tmp_path / "missing")

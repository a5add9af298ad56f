"""``hf-dist report RUN_DIR`` on the run directory of a real tiny Harbor run (one process, 3 steps)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dist.cli import main as cli_main
from hf_dist.report import LOG_FILE, draw_report
from hf_dist.report.plot import PANEL_LOSS, PANEL_MEMORY, PANEL_STEP_TIME, PANEL_THROUGHPUT

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--preset", "tiny", "--num_conversations", "160", "--max_seq_len", "64", "--eval_fraction", "0.1",
    "--global_batch_size", "8", "--per_device_train_batch_size", "4", "--max_steps", "3", "--logging_steps", "1",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("harbor-tiny")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(ROOT / "examples" / "harbor" / "train.py"), *TINY, "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_report_draws_the_four_panels(run_dir, capsys):
    assert len((run_dir / LOG_FILE).read_text().splitlines()) >= 3
    assert cli_main(["report", str(run_dir)]) == 0
    assert "report.png" in capsys.readouterr().out
    out, panels = draw_report(run_dir, run_dir / "again.png")
    assert panels == [PANEL_LOSS, PANEL_THROUGHPUT, PANEL_MEMORY, PANEL_STEP_TIME]
    from PIL import Image

    for png in (run_dir / "report.png", out):
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == (2000, 400)
            assert len(set(image.convert("L").get_flattened_data())) > 16  # curves and text, not a blank canvas


def test_report_falls_back_to_trainer_state(tmp_path):
    import json

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

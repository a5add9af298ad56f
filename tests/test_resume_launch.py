"""End to end: the Harbor recipe under `accelerate launch` resumes, never overwrites an earlier run, and a
save never writes into a checkpoint of another format.

One FSDP2 run of 4 steps saves checkpoint-2 and -4. From a copy of its checkpoint-2, `--resume_from_checkpoint
true` continues to step 4 with the same losses (1e-6); a relaunch into (a copy of) the first run's folder without
the flag starts fresh and moves the first run's checkpoints, byte for byte, into `previous_run-<time>/`; one
process resuming the FSDP2 checkpoint-2 sets the hf_dist checkpoint-4 (a continuation it abandons) aside whole
and saves a Trainer-native checkpoint-4 with no file of the old one in it.
A DDP run's (Trainer-native) checkpoint exports to a verified Hub folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_harness import ROOT, TRAIN, launch_env

COMMON = [
    "--preset", "tiny", "--num_conversations", "96", "--max_seq_len", "48", "--eval_fraction", "0",
    "--per_device_train_batch_size", "2", "--global_batch_size", "8", "--max_steps", "4", "--logging_steps", "1",
    "--lr_scheduler_type", "linear", "--warmup_steps", "1", "--base_learning_rate", "2e-3", "--base_batch_size", "8",
    "--save_strategy", "steps", "--save_steps", "2",
]


def _launch(out_dir: Path, *extra: str, processes: int = 2, config: str = "fsdp") -> subprocess.CompletedProcess:
    if processes == 1:
        cmd = [sys.executable, str(TRAIN)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
               str(TRAIN)]
    cmd += [*COMMON, "--output_dir", str(out_dir), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _losses(out_dir: Path) -> dict[int, float]:
    lines = (out_dir / "log_history.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "full"
    _ok(_launch(out))
    return out


def test_recipe_resumes_from_latest(first_run, tmp_path):
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copytree(first_run / "checkpoint-2", cut / "checkpoint-2")
    (cut / "latest").write_text("checkpoint-2\n")
    _ok(_launch(cut, "--resume_from_checkpoint", "true"))
    full, resumed = _losses(first_run), _losses(cut)
    assert sorted(resumed) == [3, 4]  # it continued at step 3, not from step 1
    for step in (3, 4):
        torch.testing.assert_close(resumed[step], full[step], atol=1e-6, rtol=0)
    assert (cut / "latest").read_text().strip() == "checkpoint-4"


def test_relaunch_without_flag_moves_the_first_run_aside_untouched(first_run, tmp_path):
    from hf_dist.checkpoint import read_manifest

    run = tmp_path / "again"
    shutil.copytree(first_run, run, ignore=shutil.ignore_patterns("final", "data"))
    before = {p.relative_to(run): p.read_bytes() for p in run.glob("checkpoint-*/**/*") if p.is_file()}
    proc = _launch(run, "--max_steps", "2", processes=1)  # a fresh start, as the Trainer allows
    _ok(proc)
    (aside,) = run.glob("previous_run-*")
    assert proc.stdout.count("moved them into") == 1 and str(aside) in proc.stdout
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-2", "checkpoint-4", "latest"]
    after = {p.relative_to(aside): p.read_bytes() for p in aside.glob("checkpoint-*/**/*") if p.is_file()}
    assert after == before
    assert read_manifest(aside / "checkpoint-4").step == 4
    assert (run / "checkpoint-2" / "trainer_state.json").is_file() and not (run / "checkpoint-4").exists()


def test_other_format_never_mixes_into_a_checkpoint(first_run, tmp_path):
    """One process (Trainer-native saves) resumes the FSDP2 checkpoint-2; hf_dist's checkpoint-4 is set aside whole."""
    run = tmp_path / "mixed"
    shutil.copytree(first_run, run, ignore=shutil.ignore_patterns("final", "data"))
    _ok(_launch(run, "--resume_from_checkpoint", str(run / "checkpoint-2"), processes=1))
    files = {p.name for p in (run / "checkpoint-4").iterdir()}
    assert "trainer_state.json" in files and "model.safetensors" in files
    assert not files & {"manifest.json", "COMPLETE", "dcp", "rng", "hf", "train_state.pt"}, files
    assert not (run / "latest").exists()  # it named the hf_dist checkpoint set aside, and went with it
    (aside,) = run.glob("previous_run-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-4", "latest"]
    assert (aside / "checkpoint-4" / "COMPLETE").is_file()
    resumed = _losses(run)
    for step in (3, 4):  # 2 ranks x accumulation 2 -> 1 process x accumulation 4: same global batch
        torch.testing.assert_close(resumed[step], _losses(first_run)[step], atol=1e-5, rtol=0)
    from hf_dist.trainer.resume import newest_checkpoint

    assert newest_checkpoint(run) == run / "checkpoint-4"


def test_ddp_checkpoint_exports_to_a_verified_hub_folder(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.cli import main

    run = tmp_path / "ddp"
    _ok(_launch(run, "--max_steps", "2", config="ddp"))
    ckpt = run / "checkpoint-2"
    assert (ckpt / "rng_state_1.pth").is_file() and not (ckpt / "manifest.json").exists()  # the Trainer's own
    out = tmp_path / "hub"
    assert main(["checkpoint", "export", str(ckpt), str(out), "--max-shard-size", "200KB"]) == 0
    printed = capsys.readouterr().out
    assert "records no checksums" in printed and "verified tensor by tensor" in printed
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "tokenizer.json").is_file()
    assert not (out / "optimizer.pt").exists() and not (out / "trainer_state.json").exists()
    torch.testing.assert_close(dict(AutoModelForCausalLM.from_pretrained(str(out)).state_dict()),
                               dict(AutoModelForCausalLM.from_pretrained(str(ckpt)).state_dict()), atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(str(out)).vocab_size == AutoTokenizer.from_pretrained(str(ckpt)).vocab_size
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated: refused, the earlier export kept
    assert main(["checkpoint", "export", str(ckpt), str(out), "--overwrite"]) == 2
    assert f"{ckpt}: the model does not load" in capsys.readouterr().err
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1

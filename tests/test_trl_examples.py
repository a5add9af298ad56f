"""The DPO and GRPO examples (``examples/dpo/train.py``, ``examples/grpo/train.py``) as a user runs them: ``torchrun
--nproc-per-node 2`` on CPU (gloo) with the real SmolLM2-135M-Instruct, at a reduced setting (2 optimizer steps of a
small global batch, short sequences, a checkpoint after each step), in the layout each runs by default (DPO: FSDP2,
GRPO: DDP).

Each example runs once uninterrupted. Then a second run starts from an output folder holding only that run's step-1
checkpoint, as a run stopped after that checkpoint leaves it, and is launched again with
``--resume_from_checkpoint true``: it must train only step 2 and, through ``trl_parity.assert_trl_parity``, end with the
uninterrupted run's logged figures (the same names) for every step (every figure logged but ``NOT_RESTORED``: loss
and gradient norm, DPO rewards and margins, GRPO reward mean and std, KL, completion lengths...) and its final weights
within 1e-6 (gradient norms 1e-5 relative).
The uninterrupted run's weights must differ from the pretrained ones (else the comparison proves nothing), and its
log must carry the numbers the example prints: DPO margins (non-zero at step 2: at step 1 the policy is its
reference) and GRPO rewards.

Disk: the resumed run saves no checkpoint (``--save_strategy no``: nothing reads one), the step-1 checkpoint is moved
into the resumed run's folder and the uninterrupted run's step-2 checkpoint removed, and the step-1 checkpoint is
removed once the resumed run has read it: a test leaves its two ``final`` folders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch_harness import saved_weights
from trl_parity import assert_trl_parity

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-6
REDUCED = {  # example -> flags of the reduced setting (2 steps, each of 2 micro batches per rank)
    "dpo": ["--global_batch_size", "4", "--per_device_train_batch_size", "1", "--max_length", "48",
            "--num_pairs", "8"],
    "grpo": ["--num_generations", "4", "--global_batch_size", "8", "--per_device_train_batch_size", "2",
             "--max_completion_length", "16", "--num_questions", "8"],
}
LAYOUT = {"dpo": "FSDP2 FULL_SHARD", "grpo": "DDP"}  # what each example runs by default
NOT_RESTORED = {"dpo": ("num_tokens",), "grpo": ()}
"""Logged figures a resumed run does not continue: TRL's DPOTrainer counts ``num_tokens`` in memory (from 0 at each
start, not in the checkpoint), so the resumed run's count restarts."""
PRINTED = {"dpo": ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected"),
           "grpo": ("reward", "reward_std", "rewards/short_answer_reward/mean", "kl", "completions/mean_length")}


def _launch(example: str, model_dir: str, out: Path, *extra: str) -> str:
    """``torchrun --nproc-per-node 2 examples/<example>/train.py`` with the reduced flags; its stdout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(ROOT / "examples" / example / "train.py"), "--model_name_or_path", model_dir,
               "--output_dir", str(out), "--max_steps", "2", "--save_steps", "1", *REDUCED[example], *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _metrics(out: Path) -> dict[str, list]:
    """The run's logged figures, ``{name: per-step values}`` (every step logs the same names)."""
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2], steps
    assert all(set(s) == set(steps[0]) for s in steps), steps
    return {name: [s[name] for s in steps] for name in steps[0]}


@pytest.mark.parametrize("example", ["dpo", "grpo"])
def test_example_runs_and_resumes_exactly(example, demo_model, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    printed = _launch(example, str(demo_model), whole)
    assert re.findall(r"^step +(\d)/2 ", printed, flags=re.M) == ["1", "2"], printed
    assert re.search(r"^world size +2$", printed, flags=re.M), printed  # one training over 2 processes
    assert re.search(rf"^layout +{LAYOUT[example]} ", printed, flags=re.M), printed

    # A run stopped after its step-1 checkpoint: that checkpoint and nothing the later step wrote.
    resumed.mkdir()
    shutil.move(whole / "checkpoint-1", resumed / "checkpoint-1")
    shutil.rmtree(whole / "checkpoint-2")
    printed_again = _launch(example, str(demo_model), resumed, "--resume_from_checkpoint", "true",
                            "--save_strategy", "no")
    shutil.rmtree(resumed / "checkpoint-1")
    assert re.findall(r"^step +(\d)/2 ", printed_again, flags=re.M) == ["2"], printed_again  # only step 2 trained

    metrics, metrics_again = _metrics(whole), _metrics(resumed)
    trained = saved_weights(whole / "final")
    assert set(PRINTED[example]) <= set(metrics), sorted(metrics)
    assert_trl_parity(metrics_again, saved_weights(resumed / "final"), metrics, trained, atol=ATOL,
                      names=[name for name in metrics if name not in NOT_RESTORED[example]], what=f"{example} resumed")
    pretrained = saved_weights(Path(demo_model))
    assert any(not torch.equal(tensor, pretrained[name]) for name, tensor in trained.items() if name in pretrained)

    if example == "dpo":
        assert metrics["rewards/margins"][0] == 0.0 and metrics["rewards/margins"][1] != 0.0
    else:
        assert all(0.0 <= reward <= 1.0 for reward in metrics["reward"])

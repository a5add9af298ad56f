"""The end-to-end tests' launches, and what a launched run leaves, in ``parity.assert_parity``'s shape.

- ``run_recipe(cmd, out_dir)`` / ``launch(config, out_dir, *flags)``: ``examples/harbor/train.py`` run as a user runs
  it (one process, or ``accelerate launch --config_file accelerate_configs/<config>.yaml``) with a clean
  environment (``launch_env``); each returns the run's ``summary.json``.
- ``launched_run(out_dir)``: a finished run's figures and weights read back from its output folder, as
  ``{"losses", "norms", "state"}``: the logged training losses and gradient norms (the Trainer's ``grad_norm``, before
  clipping) of every logged step, from ``log_history.jsonl`` (``--dist_logging``) or the ``trainer_state.json``
  ``Trainer.save_state`` writes, and the weights of the model the run saved (``final/``: a whole model, or a LoRA
  adapter). A launched run and its one-process reference are compared by ``assert_parity(launched_run(a),
  launched_run(b))``; no test reads these files its own way.

What is not here: the launches' own checks (the layout line, the reload, answers), which each test asserts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ADAM_EPSILON = "1e-6"
"""AdamW's epsilon in the launched recipes whose weights are compared (the recipe's default is 1e-8). AdamW moves a
weight by about ``lr * g / (|g| + eps)``: where a gradient element is near zero, a rounding-level difference ``d`` in it
moves the weight by up to ``lr * d / eps``. Measured (2026-11-27, fp32, CPU) with 1e-8: the layouts' saved weights
differed from one process's on a few elements only, by up to 1.7e-5 (ZeRO-3), 2.7e-5 (PP2), 3.8e-4 (CP2), and a
one-process run with another micro-batch split (the same global batch) moved the same elements, by up to 5.7e-5,
while losses and gradient norms agreed within 2e-6. With 1e-6 every weight of those runs is within 1.8e-6 of one
process, so weights compare at 1e-5; elements with a gradient well above 1e-6 still take Adam's
normalised step."""
TRAIN = ROOT / "examples" / "harbor" / "train.py"
COMMON = [
    "--preset", "tiny", "--num_conversations", "160", "--max_seq_len", "64", "--eval_fraction", "0",
    "--per_device_train_batch_size", "2", "--global_batch_size", "8", "--max_steps", "5", "--logging_steps", "1",
    "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--base_learning_rate", "1e-3", "--base_batch_size", "8",
    *("--adam_epsilon", ADAM_EPSILON),
]
"""The tiny recipe of the launch tests: 5 AdamW steps of a global batch of 8, every step logged."""


def launch_env() -> dict[str, str]:
    """This environment without a launcher's variables (a test run inside one must not leak them), one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for key in list(env):
        if key.startswith(("ACCELERATE_", "FSDP_")) or key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            del env[key]
    return env


def run_recipe(cmd: list[str], out_dir: Path, cwd: Path = ROOT) -> dict:
    """``cmd --output_dir out_dir``, which must succeed; its ``summary.json``."""
    proc = subprocess.run(cmd + ["--output_dir", str(out_dir)], cwd=cwd, env=launch_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out_dir / "summary.json").read_text())


def one_process(out_dir: Path, *flags: str) -> dict:
    """The recipe with ``COMMON`` and ``flags`` in one process (the reference); its ``summary.json``."""
    return run_recipe([sys.executable, str(TRAIN), *COMMON, *flags], out_dir)


def launch(config: str, out_dir: Path, *flags: str, cwd: Path = ROOT) -> dict:
    """The recipe with ``COMMON`` and ``flags`` under ``accelerate launch`` with a shipped config; its summary."""
    yaml = ROOT / "accelerate_configs" / f"{config}.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml), str(TRAIN), *COMMON, *flags]
    return run_recipe(cmd, out_dir, cwd)


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files a ``save_model`` wrote into ``folder`` (a model's shards or an adapter)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no safetensors file in {folder}"
    return {name: tensor for file in files for name, tensor in load_file(str(file)).items()}


def launched_run(out_dir: Path, weights: str | None = "final") -> dict:
    """The run in ``out_dir`` as ``assert_parity`` reads it: ``losses`` and ``norms`` of its logged training steps
    (in step order, each step once), ``state``: the weights saved under ``out_dir/weights`` (None: the run saved its
    model into ``out_dir`` itself)."""
    from hf_dist.report.log_history import read_log_history

    steps = {record["step"]: record for record in read_log_history(out_dir) if "loss" in record}
    assert steps, f"{out_dir} logged no training loss"
    run = {"losses": [steps[s]["loss"] for s in sorted(steps)],
           "norms": [steps[s]["grad_norm"] for s in sorted(steps)],
           "state": saved_weights(Path(out_dir) / weights if weights else Path(out_dir))}
    return run

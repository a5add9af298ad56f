"""Launch the Harbor recipe (tiny) N times per layout under a CPU hog and count abnormal exits.

    python bench/stress.py --runs 20 --layouts ddp fsdp --hog 4

Each run is `accelerate launch --config_file accelerate_configs/<layout>.yaml examples/harbor/train.py --preset
tiny` with a few steps, a save and the final export, in a fresh output folder, while ``--hog`` busy-loop
processes compete for the cores. A run is clean when it exits 0 with no "terminate called" in its output.
Prints one row per layout: runs, clean, abnormal exit codes, and the median wall time.

Figures (2-core CPU machine shared with other jobs, load average ~20 before the hog, 2026-11-23): see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--num_conversations", "64", "--max_seq_len", "32", "--eval_fraction", "0",
        "--per_device_train_batch_size", "2", "--global_batch_size", "4", "--max_steps", "3", "--logging_steps", "1",
        "--save_strategy", "steps", "--save_steps", "2"]


def _spin() -> None:
    while True:
        pass


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {k: v for k, v in env.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}


def launch_once(layout: str, out: Path) -> tuple[int, bool, float]:
    """(exit code, whether "terminate called" was printed, seconds) of one launch."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{layout}.yaml",
           str(ROOT / "examples" / "harbor" / "train.py"), *TINY, "--output_dir", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        (out.parent / f"{out.name}.log").write_text(text)
    return proc.returncode, "terminate called" in text, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="launches per layout (default 20)")
    parser.add_argument("--layouts", nargs="+", default=["ddp", "fsdp"], help="accelerate_configs/<name>.yaml")
    parser.add_argument("--hog", type=int, default=4, help="busy-loop processes running meanwhile (default 4)")
    parser.add_argument("--keep", default=None, help="folder for the runs and the logs of failed ones")
    args = parser.parse_args(argv)
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.hog)]
    for hog in hogs:
        hog.start()
    root = Path(args.keep or tempfile.mkdtemp(prefix="hf_dist_stress_"))
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for layout in args.layouts:
            results = [launch_once(layout, root / f"{layout}-{i}") for i in range(args.runs)]
            bad = [(code, term) for code, term, _ in results if code != 0 or term]
            rows.append((layout, len(results), len(results) - len(bad),
                         ", ".join(f"{c}{' (terminate called)' if t else ''}" for c, t in bad) or "-",
                         statistics.median(s for _, _, s in results)))
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"{'layout':<8} {'runs':>5} {'clean':>6}  {'median s':>8}  abnormal exits  (hog: {args.hog} busy loops, "
          f"1-min load average at the end: {os.getloadavg()[0]:.1f})")
    for layout, runs, clean, bad, median in rows:
        print(f"{layout:<8} {runs:>5} {clean:>6}  {median:>8.1f}  {bad}")
    print(f"runs in {root}")
    return 0 if all(clean == runs for _, runs, clean, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

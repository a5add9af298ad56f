"""Launch a tiny 2-rank DistTrainer run N times per layout with ``torchrun`` and count exits that are not 0.

    python bench/exit_stress.py --runs 17 --layouts tp2 ep2 pp2 [--hog 2] [--keep DIR]

Each run is ``torchrun --nproc_per_node 2 bench/exit_stress.py --worker LAYOUT OUT``: a tiny model of the type the
layout names (qwen3_moe under TP=2, hunyuan_v1_moe under EP=2 x FSDP2, qwen3_5_text under PP=2: the runs that once
ended in "terminate called without an active exception"), 3 optimizer steps, a checkpoint at step 2 (not under TP:
kept as measured, when hf_dist refused checkpoints of TP-split fused experts), the final model saved, rank 0 writes ``result.json``. A run is clean when torchrun exits 0, neither rank printed "terminate called" and the
result was written. ``--hog`` busy loops compete for the cores meanwhile (the abort is a race with exit).
Prints one row per layout: runs, clean, the abnormal exit codes, the median wall time; the logs of abnormal runs are
kept under ``--keep``. The recipe under ``accelerate launch`` has its own stress bench, ``bench/stress.py``.

Not a test: a run takes 15-40 s on 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# layout -> (model type, config overrides, DistTrainingArguments overrides). The TP run saves only its final model,
# as when docs/benchmarks.md's figures were measured (TP-split fused MoE experts could not be checkpointed then).
LAYOUTS: dict[str, tuple[str, dict, dict]] = {
    "tp2": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2}, {"tp_size": 2, "save_strategy": "no"}),
    "ep2": ("hunyuan_v1_moe", {"num_experts": 4, "moe_topk": 2, "head_dim": 8},
            {"ep_size": 2, "fsdp": "full_shard", "fsdp_config": {"version": 2}}),
    "pp2": ("qwen3_5_text", {}, {"pp_size": 2}),
}


def worker(layout: str, out: str) -> None:
    """One rank of a run (started by torchrun)."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.models.twin import tiny_twin

    model_type, config_overrides, overrides = LAYOUTS[layout]
    torch.manual_seed(0)
    config = tiny_twin(AutoConfig.for_model(model_type, **config_overrides), layers=2, width=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(6, config.vocab_size, (16, 32), generator=gen).tolist()
    args = DistTrainingArguments(
        out, per_device_train_batch_size=1, global_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1,
        **{"save_strategy": "steps", "save_steps": 2, **overrides}, report_to=[], disable_tqdm=True, seed=0,
        layout_canary=False)
    trainer = DistTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))
    trainer.train()
    trainer.save_model(f"{out}/final")
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        Path(out, "result.json").write_text(json.dumps({"layout": layout, "losses": losses}))


def _spin() -> None:
    while True:
        pass


def launch_once(layout: str, out: Path) -> tuple[int, bool, float]:
    """(torchrun's exit code, whether a rank printed "terminate called" or wrote no result, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env = {k: v for k, v in env.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), "--worker", layout, str(out)]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()  # cwd: the run's folder, where a core dump lands under `ulimit -c unlimited`
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    bad = "terminate called" in text or not (out / "result.json").is_file()
    if proc.returncode != 0 or bad:
        (out.parent / f"{out.name}.log").write_text(text)
    return proc.returncode, bad, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=17, help="launches per layout (default 17)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes running meanwhile (default 0)")
    parser.add_argument("--keep", default=None, help="folder for the runs and the logs of abnormal ones")
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(args.hog)]
    for hog in hogs:
        hog.start()
    root = Path(args.keep or tempfile.mkdtemp(prefix="hf_dist_exit_stress_"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[tuple[int, bool, float]]] = {layout: [] for layout in args.layouts}
    try:
        for i in range(args.runs):  # layouts interleaved: load changes over the minutes a batch takes
            for layout in args.layouts:
                code, bad, seconds = launch_once(layout, root / f"{layout}-{i}")
                results[layout].append((code, bad, seconds))
                print(f"{layout}-{i}: exit {code}{' (abnormal)' if code or bad else ''} {seconds:.1f}s", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"\n{'layout':<6} {'model':<16} {'runs':>5} {'exit 0':>7} {'clean':>6} {'median s':>9}  abnormal exits  "
          f"(hog: {args.hog} busy loops; 1-min load average at the end: {os.getloadavg()[0]:.1f})")
    for layout, rows in results.items():
        abnormal = ", ".join(f"{c}{' (terminate called or no result)' if b else ''}" for c, b, _ in rows if c or b)
        print(f"{layout:<6} {LAYOUTS[layout][0]:<16} {len(rows):>5} {sum(c == 0 for c, _, _ in rows):>7} "
              f"{sum(not c and not b for c, b, _ in rows):>6} {statistics.median(s for *_, s in rows):>9.1f}  "
              f"{abnormal or '-'}")
    print(f"runs in {root}")
    return 0 if all(not c and not b for rows in results.values() for c, b, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

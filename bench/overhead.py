"""Step time of DistTrainer vs the plain HF Trainer on the same tiny run and layout, in the same run.

    python bench/overhead.py [--world-size 2] [--steps 30] [--rounds 3]

Both trainers train the same tiny Llama on the same data with the same arguments (DistTrainer adds only its
contract, layout checks and, with dist_logging=True as here, throughput logging). Rounds alternate plain/dist
to share machine noise; the table gives median optimizer-step times and their ratio (target <= 1.03). With
--world-size 2 both run as DDP on 2 gloo ranks (the plain Trainer with use_cpu=True, which it needs on CPU).

Measured 2026-11-21 on the 2-core x86_64 CPU machine (no GPU, otherwise idle), default sizes:

    layout              rounds  Trainer (ms)  DistTrainer (ms)  ratio
    single process         5        29.9           30.6         1.024
    single process         3        29.4           30.5         1.037
    DDP x2 (gloo)          3        44.8           46.0         1.028

The spread between runs (about +-1.5%) is as large as the overhead itself; what DistTrainer adds per micro
step is token counting and two clock reads (CUDA: two events, read at the next log).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _step_times(trainer_cls, args_cls, steps: int) -> list[float]:
    from transformers import TrainerCallback

    from hf_dist.models import build_tiny_model
    from trainer_harness import VOCAB, token_dataset

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        args = args_cls(
            output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            learning_rate=1e-3, logging_steps=5, save_strategy="no", report_to=[], disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), dataloader_pin_memory=False, ddp_find_unused_parameters=False,
            **({"dist_logging": True} if args_cls.__name__ == "DistTrainingArguments" else {}),
        )
        model = build_tiny_model(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4)
        trainer = trainer_cls(model=model, args=args, train_dataset=token_dataset(n=512), callbacks=[timer])
        trainer.train()
    return timer.times[2:]  # the first steps warm up allocators and threads


def _measure(rank: int, world_size: int, port: int, steps: int, rounds: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from transformers import Trainer, TrainingArguments, logging as hf_logging

    from hf_dist import DistTrainer, DistTrainingArguments

    hf_logging.set_verbosity_error()
    results = {"plain": [], "dist": []}
    for _ in range(rounds):
        results["plain"] += _step_times(Trainer, TrainingArguments, steps)
        results["dist"] += _step_times(DistTrainer, DistTrainingArguments, steps)
    if rank == 0:
        queue.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_measure, args=(r, opts.world_size, port, opts.steps, opts.rounds, queue))
             for r in range(opts.world_size)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join()
    plain, dist = statistics.median(results["plain"]), statistics.median(results["dist"])
    layout = "single process" if opts.world_size == 1 else f"DDP x{opts.world_size} (gloo)"
    print(f"\nDistTrainer overhead — {layout}, tiny Llama (hidden 128, 4 layers), micro 4 x accumulation 2")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{'GPU' if torch.cuda.is_available() else 'no GPU'}; {datetime.date.today()}")
    print(f"{'trainer':<14}{'median step (ms)':>18}{'steps':>8}")
    print(f"{'Trainer':<14}{plain * 1e3:>18.1f}{len(results['plain']):>8}")
    print(f"{'DistTrainer':<14}{dist * 1e3:>18.1f}{len(results['dist']):>8}")
    print(f"{'ratio':<14}{dist / plain:>18.3f}   (target <= 1.03)")


if __name__ == "__main__":
    main()

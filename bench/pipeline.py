"""Pipeline utilisation per schedule and micro-batch count: measured busy/wall next to m / (m + p - 1).

Run (2 pipeline ranks, gloo on CPU; one thread per rank)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/pipeline.py [--layers 8 --hidden 128 --seq 64]

Each micro-batch holds ``--micro-batch`` sequences, so the work per micro-batch is the same for every m and
the step grows with m. Busy time is the time a rank spends inside its stages' forward and backward (input and
weight) computations; wall time is the whole ``train_step`` (schedule, sends, waits, gradient reduction).
Utilisation = busy / wall, per rank; the table shows the lowest rank (the one that waits most) and the mean.
The theory column is the fill-drain bound m / (m + p - 1) with p pipeline ranks; interleaved and zero-bubble
schedules are built to beat it.

Rank 0 prints the table. Not a test: figures depend on the machine (record them with machine and date).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from hf_dist import ParallelDims
from hf_dist.models.tiny import build_tiny_model
from hf_dist.pipeline_parallel import SCHEDULES, PipelineConfig, PipelinedCausalLM, theoretical_utilisation

TIMED_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def instrument(pipe: PipelinedCausalLM) -> list[float]:
    """Accumulate the compute time of every local stage into the returned one-element list."""
    busy = [0.0]
    for stage in pipe.stages:
        for name in TIMED_METHODS:
            original = getattr(stage, name)

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - start

            setattr(stage, name, timed)
    return busy


def measure(args, dims: ParallelDims, schedule: str, microbatches: int) -> tuple[float, float]:
    """(median step seconds, median utilisation of this rank) over ``args.steps`` steps after one warm-up."""
    model = build_tiny_model(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, seed=0
    )
    pipe = PipelinedCausalLM(model, dims=dims, config=PipelineConfig(schedule=schedule, microbatches=microbatches))
    busy = instrument(pipe)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, args.vocab, (microbatches * args.micro_batch, args.seq), generator=g)}
    times, utils = [], []
    for step in range(args.steps + 1):
        dist.barrier()
        busy[0] = 0.0
        start = time.perf_counter()
        pipe.train_step(batch)
        wall = time.perf_counter() - start
        for p in pipe.parameters():
            p.grad = None
        if step > 0:
            times.append(wall)
            utils.append(busy[0] / wall)
    return statistics.median(times), statistics.median(utils)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, pp=world, dp_shard=1)
    dims.build_mesh("cpu")
    rows = []
    for schedule in args.schedules:
        for m in args.microbatches:
            try:
                step, util = measure(args, dims, schedule, m)
                gathered = [None] * world
                dist.all_gather_object(gathered, util)
                rows.append((schedule, m, step, min(gathered), sum(gathered) / world))
            except ValueError as error:  # a schedule that refuses this m says why
                rows.append((schedule, m, None, str(error).split(";")[0], None))
    if dist.get_rank() == 0:
        print(f"pp={world}, layers={args.layers}, hidden={args.hidden}, seq={args.seq}, "
              f"micro-batch={args.micro_batch} sequences, threads/rank={torch.get_num_threads()}")
        print(f"{'schedule':<18}{'m':>4}{'step s':>9}{'util min':>10}{'util mean':>11}{'theory':>8}")
        for schedule, m, step, lo, mean in rows:
            theory = theoretical_utilisation(m, world)
            if step is None:
                print(f"{schedule:<18}{m:>4}  n/a: {lo}")
            else:
                print(f"{schedule:<18}{m:>4}{step:>9.3f}{lo:>10.2f}{mean:>11.2f}{theory:>8.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

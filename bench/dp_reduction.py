"""Gradient reduction of replicated data parallelism (dp without FSDP): collectives and time per optimizer step.

    python bench/dp_reduction.py [--tp 1] [--steps 8] [--accumulation 4] [--rounds 2]

Ranks: 2 x tp gloo processes, dp = 2 (with --tp 2: TP2 x DP2 on 4 ranks). A tiny Llama (hidden 256, 4 layers,
vocab 2048, ~17 MB of fp32 gradients) trains with gradient accumulation; each row is one way of reducing:

- ``per parameter, every micro step`` -- hf_dist before buckets: a blocking ``all_reduce`` of each parameter's
  gradient as autograd accumulates it, on every micro step;
- ``buckets of N MB, last micro step`` -- ``hf_dist.data_parallel.replicate``: ``no_sync`` on the first
  micro steps, then one asynchronous ``all_reduce`` per bucket, started as the bucket fills in the last backward.

``in backward``: buckets whose all_reduce started from the hooks, before the last backward ended (the rest
start at its end). Collectives and bytes are counted by wrapping ``torch.distributed.all_reduce`` in the ranks
(TP's own DTensor collectives do not go through it); the time is the median optimizer step (each step's slowest
rank), after two warm-up steps, pooled over rounds that alternate the variants. Not a test: nothing is asserted.

Measured 2026-11-24 on the 2-core x86_64 CPU machine (no GPU), shared (load average 4-7), default sizes:

    reduction                           buckets  all_reduce/step  MB/step  DP2 step (ms)  TP2 x DP2 step (ms)
    per parameter, every micro step         -          156       60.3/34.2      589.0           1558.6
    buckets of 25 MB, last micro step       1            1       15.1/8.5       424.6            835.0
    buckets of 4 MB, last micro step      4 / 2       4 / 2      15.1/8.5       410.9            825.5

(MB/step: DP2 / TP2 x DP2, where each rank reduces its TP shards.) Under this load the step times move by
+-20% between runs; the collective counts and bytes do not.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

WARMUP, MICRO, SEQ, VOCAB = 2, 2, 64, 2048
VARIANTS = {"per parameter, every micro step": None, "buckets of 25 MB, last micro step": 25.0,
            "buckets of 4 MB, last micro step": 4.0}
"""row label -> bucket size in MB (None: the per-parameter reduction hf_dist had before)"""


def _per_parameter(model, group) -> None:
    """The reduction hf_dist had before buckets, for comparison: every gradient, blocking, every micro step."""
    size = dist.get_world_size(group)

    def average(param):
        local = getattr(param.grad, "_local_tensor", param.grad)
        dist.all_reduce(local, group=group)
        local.div_(size)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


def _build(dims, bucket_mb: float | None):
    from hf_dist import parallelize
    from hf_dist.data_parallel import replicate
    from hf_dist.models import build_tiny_model

    model = build_tiny_model(seed=0, vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                             intermediate_size=688)
    model = parallelize(model, dims, replicate_gradients=False)
    if bucket_mb is None:
        _per_parameter(model, dims.get_mesh("dp").get_group())
        return model
    return replicate(model, dims.get_mesh("dp"), bucket_cap_mb=bucket_mb)


def _run_variant(dims, bucket_mb: float | None, steps: int, accumulation: int) -> dict:
    from hf_dist.metrics.ledger import group_labels, measure

    model = _build(dims, bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dims.dp_rank(dist.get_rank()))
    labels = group_labels(dims)
    times = []
    with contextlib.ExitStack() as counting:
        for step in range(WARMUP + steps):
            if step == WARMUP:
                ledger = counting.enter_context(measure(labels, flops=False))
            dist.barrier()
            start = time.perf_counter()
            for i in range(accumulation):
                ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
                deferred = bucket_mb is not None and i < accumulation - 1
                with model.no_sync() if deferred else contextlib.nullcontext():
                    (model(input_ids=ids, labels=ids).loss / accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    dp = [t for k, t in ledger.comms.items() if k.kind == "all_reduce" and "dp" in k.group.split("/")]
    counted = {"calls": sum(t.count for t in dp), "bytes": sum(t.bytes for t in dp)}
    slowest = torch.tensor(times[WARMUP:])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    reducer = getattr(model, "gradient_reducer", None)
    return {"calls": counted["calls"] / steps, "mb": counted["bytes"] / steps / 2**20, "times": slowest.tolist(),
            "buckets": len(reducer.buckets) if reducer else None, "overlapped": reducer.overlapped if reducer else None}


def _ranks(rank: int, world_size: int, tp: int, steps: int, accumulation: int, rounds: int) -> dict:
    """Every variant once per round, rounds alternating (machine noise shared); step times pooled over rounds."""
    from hf_dist import ParallelDims

    dims = ParallelDims(world_size=world_size, tp=tp, dp_shard=world_size // tp)
    dims.build_mesh("cpu")
    rows: dict[str, dict] = {}
    for _ in range(rounds):
        for label, mb in VARIANTS.items():
            run = _run_variant(dims, mb, steps, accumulation)
            times = rows.get(label, {}).get("times", []) + run["times"]
            rows[label] = {**run, "times": times}
    return {label: {**row, "ms": statistics.median(row["times"]) * 1e3} for label, row in rows.items()}


def main() -> None:
    from dist_utils import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    world = 2 * opts.tp
    rows = run_distributed(_ranks, world, opts.tp, opts.steps, opts.accumulation, opts.rounds, timeout_s=3600)[0]
    layout = f"TP{opts.tp} x DP2" if opts.tp > 1 else "DP2"
    print(f"\nreplicated dp gradient reduction — {layout} ({world} gloo ranks), tiny Llama (hidden 256, 4 layers), "
          f"micro {MICRO} x seq {SEQ}, accumulation {opts.accumulation}, {opts.rounds} rounds x {opts.steps} steps")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{'GPU' if torch.cuda.is_available() else 'no GPU'}; {datetime.date.today()}")
    print(f"{'reduction':<36}{'buckets':>8}{'in backward':>12}{'all_reduce/step':>17}{'MB/step':>9}{'step (ms)':>11}")
    for label, r in rows.items():
        buckets, started = ("-", "-") if r["buckets"] is None else (str(r["buckets"]), str(r["overlapped"]))
        print(f"{label:<36}{buckets:>8}{started:>12}{r['calls']:>17.0f}{r['mb']:>9.1f}{r['ms']:>11.1f}")


if __name__ == "__main__":
    main()

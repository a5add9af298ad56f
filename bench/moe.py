"""Expert parallelism vs FSDP2 alone on a MoE model whose experts dominate: step time and per-rank memory.

    python bench/moe.py [--steps 6] [--rounds 2]

2 gloo ranks (CPU), a Qwen3-MoE slice shaped so the experts hold most parameters (hidden 256, 4 layers, 16 experts
of width 512, top-4, vocab 2048: ~27 M parameters, ~25 M in experts), micro batch 4 x 128 tokens per rank, AdamW.
Rows: ``FSDP2`` (every rank runs every expert, expert weights all-gathered per layer) and ``EP2 x FSDP2``
(``ep_size=2``: 8 experts per rank, tokens exchanged all-to-all; expert FSDP degree 1, dense parameters still
sharded over dp). Columns: the median optimizer step (slowest rank) after 2 warm-up steps, pooled over rounds;
``states MB``: parameters + gradients + AdamW states this rank holds (local shards, counted from the tensors);
``peak RSS MB``: the rank process's peak resident memory (``ru_maxrss``; includes Python, torch and the
activations; only the variant run first in a fresh process is meaningful, so each variant runs in its own
spawn). Not a test: nothing is asserted.

Measured 2026-11-24 on the 2-core x86_64 CPU machine (no GPU), shared (load average 12.6), default sizes:

    layout           step (ms)  states MB/rank  peak RSS MB/rank
    FSDP2               2505.8           206.1              1157
    EP2 x FSDP2         1449.2           206.1               809

The model states per rank are the same by construction (FSDP2 already splits every parameter over the 2 ranks; EP
with expert-FSDP degree 1 gives each rank half the experts whole): EP saves the per-layer all-gather of the experts
and their gathered copies (peak RSS), and each rank computes only its experts' tokens. Step times move by +-20%
between runs under this load. No GPU was lent to this session: the GPU row (Qwen3-30B-A3B-shaped slice, tokens/s
and MFU) is not measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

WARMUP, MICRO, SEQ, VOCAB = 2, 4, 128, 2048
VARIANTS = {"FSDP2": 1, "EP2 x FSDP2": 2}
"""row label -> ep"""


def _model():
    from transformers import Qwen3MoeConfig

    from hf_dist.models.tiny import build_tiny_model

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=512,
                            num_experts=16, num_experts_per_tok=4, tie_word_embeddings=False)
    return build_tiny_model(config, seed=0)


def _state_bytes(model, optimizer) -> int:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    total += sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    for state in optimizer.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in state.values() if torch.is_tensor(v)
                     and v.dim() > 0)
    return total


def _rank(rank, world, ep, steps):
    from hf_dist import FsdpRequest, ParallelDims, parallelize

    torch.manual_seed(0)
    dims = ParallelDims(world_size=world, dp_shard=world, ep=ep)
    dims.build_mesh("cpu")
    model = parallelize(_model(), dims, fsdp=FsdpRequest())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(WARMUP + steps):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        states = _state_bytes(model, optimizer)
        optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= WARMUP:
            times.append(float(elapsed))
    from hf_dist.planner.measure import peak_rss_bytes

    rss = torch.tensor(float(peak_rss_bytes()))  # VmHWM: ru_maxrss would carry the parent's peak across exec
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    return {"times": times, "states_mb": states / 2**20, "rss_mb": float(rss) / 2**20}


def main(argv: list[str] | None = None) -> None:
    from dist_utils import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    results: dict[str, dict] = {name: {"times": []} for name in VARIANTS}
    for _ in range(args.rounds):
        for name, ep in VARIANTS.items():
            out = run_distributed(_rank, 2, ep, args.steps, timeout_s=1800)[0]
            results[name]["times"] += out["times"]
            results[name]["states_mb"], results[name]["rss_mb"] = out["states_mb"], out["rss_mb"]
    print(f"{datetime.date.today()} on {platform.machine()} CPU, {os.cpu_count()} cores, 2 gloo ranks, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'layout':<14}{'step (ms)':>12}{'states MB/rank':>16}{'peak RSS MB/rank':>18}")
    for name, r in results.items():
        print(f"{name:<14}{statistics.median(r['times']) * 1e3:>12.1f}{r['states_mb']:>16.1f}{r['rss_mb']:>18.0f}")


if __name__ == "__main__":
    main()

"""Benchmark: hf_dist tensor parallelism against transformers' own ``tp_plan="auto"``, same model, same run.

One invocation saves a randomly initialised Llama-class model to a temporary directory, then trains it for a
few steps (forward, backward, AdamW) with each TP implementation on ``--tp`` ranks: hf_dist loads it plainly
and calls ``apply_tensor_parallel``; transformers loads it with ``from_pretrained(path, tp_plan="auto",
device_mesh=...)``. A third variant, ``hf_dist+vocab``, also vocab-shards embedding and lm_head
(transformers' Llama plan shards lm_head and gathers its output). Step time: all variants live in the same
processes and their steps are interleaved, so load from other jobs hits all of them alike. Peak memory:
each variant alone in fresh processes (peak RSS growth on CPU, ``max_memory_allocated`` on GPU). The table
shows medians and the hf_dist / transformers ratios. On a GPU, ``--dtype bfloat16``.

    python bench/tp.py --tp 2 --steps 8

Not a test: nothing here asserts; the first-step losses are printed to show both variants train the same model.

Measured 2026-11-21 on a 2-core CPU machine without GPU, shared with other jobs (load 8-15), gloo, fp32,
``--steps 5 --repeats 2`` (6.0M-parameter model, batch 4 x 256): step time hf_dist / transformers 1.26
(lm_head whole on each rank) and 0.92 with ``vocab_parallel``; peak RSS growth 0.79 and 0.66 of
transformers' (which gathers full logits on every rank). Not yet measured on a GPU (bf16).
These figures predate 2026-11-23, when hf_dist's default plan became the model's own (the lm_head now
column-split with its logits gathered, as in transformers' plan, where the vocabulary divides by tp and the
embeddings are not tied); not re-measured since.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("hf_dist", "hf_dist+vocab", "transformers")
"""hf_dist+vocab: embedding and lm_head vocab-sharded too (transformers' Llama plan shards lm_head and gathers)."""


@dataclass(kw_only=True)
class BenchConfig:
    """What to measure."""

    tp: int = 2
    """Tensor-parallel degree (processes per variant)."""
    steps: int = 8
    """Timed optimizer steps per variant (after ``warmup``)."""
    warmup: int = 2
    """Untimed steps first."""
    repeats: int = 2
    """Rounds of ``steps`` interleaved steps per variant (the step time is the median over all of them)."""
    hidden: int = 256
    """Model width."""
    layers: int = 4
    """Decoder layers."""
    heads: int = 8
    """Attention heads (kv heads: half)."""
    vocab: int = 4096
    """Vocabulary size."""
    batch: int = 4
    """Sequences per step (every TP rank sees the same batch)."""
    seq: int = 256
    """Tokens per sequence."""
    dtype: str = "float32"
    """Parameter dtype: float32, or bfloat16 on a GPU."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_bytes() -> int:
    from hf_dist.planner.measure import peak_rss_bytes

    return peak_rss_bytes()  # VmHWM: ru_maxrss would carry the parent's peak across exec


def _load(variant: str, path: str, tp_mesh, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if variant == "transformers":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto", device_mesh=tp_mesh)
    from hf_dist.tensor_parallel import apply_tensor_parallel

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(tp_mesh.device_type)
    return apply_tensor_parallel(model, tp_mesh, vocab_parallel=variant == "hf_dist+vocab")


def _step(model, optimizer, batch: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """One timed optimizer step on every rank: (seconds, loss)."""
    dist.barrier()
    start = time.perf_counter()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start, loss.item()


def _setup(rank: int, cfg: BenchConfig, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cfg.tp),
                      LOCAL_RANK=str(rank))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=cfg.tp)
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    batch = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0))
    return device, init_device_mesh(device.type, (cfg.tp,), mesh_dim_names=("tp",)), batch.to(device)


def _memory_worker(rank: int, cfg: BenchConfig, path: str, port: int, queue, variant: str) -> None:
    """One variant alone in this process: its peak memory, parameter bytes and first loss."""
    device, tp_mesh, batch = _setup(rank, cfg, port)
    import transformers  # noqa: F401  (imports before the memory baseline)

    baseline = _rss_bytes()
    model = _load(variant, path, tp_mesh, getattr(torch, cfg.dtype))
    local_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = [_step(model, optimizer, batch, device)[1] for _ in range(cfg.warmup + 1)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_bytes() - baseline
    queue.put((rank, {"peak_bytes": peak, "param_bytes": local_bytes, "first_loss": losses[0]}))
    dist.barrier()
    dist.destroy_process_group()


def _timing_worker(rank: int, cfg: BenchConfig, path: str, port: int, queue) -> None:
    """Every variant in the same processes, steps interleaved, so that load from other jobs hits all alike."""
    device, tp_mesh, batch = _setup(rank, cfg, port)
    models = {v: _load(v, path, tp_mesh, getattr(torch, cfg.dtype)) for v in VARIANTS}
    optimizers = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(cfg.warmup + cfg.steps * cfg.repeats):
        order = VARIANTS[step % len(VARIANTS):] + VARIANTS[: step % len(VARIANTS)]
        for v in order:
            seconds, _ = _step(models[v], optimizers[v], batch, device)
            if step >= cfg.warmup:
                times[v].append(seconds)
    queue.put((rank, {v: statistics.median(t) for v, t in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(cfg: BenchConfig, target, *args) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, cfg, *args[:1], port, queue, *args[1:])) for r in range(cfg.tp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"{target.__name__}{args[1:]}: a rank failed, exit codes {[p.exitcode for p in procs]}")
    return [queue.get()[1] for _ in procs]


def measure(cfg: BenchConfig, path: str) -> dict[str, dict]:
    """Per variant: interleaved median step time (slowest rank), peak memory, parameter bytes, first loss."""
    step_s = {v: max(r[v] for r in _spawn(cfg, _timing_worker, path)) for v in VARIANTS}
    out = {}
    for v in VARIANTS:
        ranks = _spawn(cfg, _memory_worker, path, v)
        out[v] = {
            "step_s": step_s[v],
            "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "param_bytes": max(r["param_bytes"] for r in ranks),
            "first_loss": ranks[0]["first_loss"],
        }
    return out


def save_model(cfg: BenchConfig, path: str) -> int:
    from hf_dist.models import build_tiny_model

    model = build_tiny_model(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads // 2, max_position_embeddings=cfg.seq,
    )
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def table(cfg: BenchConfig, n_params: int, med: dict[str, dict]) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores), gloo"
    lines = [
        f"TP={cfg.tp}, Llama-class {n_params / 1e6:.1f}M params (hidden {cfg.hidden}, {cfg.layers} layers, "
        f"vocab {cfg.vocab}), batch {cfg.batch} x {cfg.seq}, {cfg.dtype}, {device}; step: median of "
        f"{cfg.steps * cfg.repeats} interleaved steps; memory: each variant alone",
        f"{'variant':<20}{'step (s)':>10}{'peak mem (MiB)':>16}{'params/rank (MiB)':>19}{'first loss':>12}",
    ]
    for v in VARIANTS:
        m = med[v]
        lines.append(f"{v:<20}{m['step_s']:>10.4f}{m['peak_bytes'] / 2**20:>16.1f}{m['param_bytes'] / 2**20:>19.2f}"
                     f"{m['first_loss']:>12.5f}")
    b = med["transformers"]
    for v in VARIANTS[:-1]:
        a = med[v]
        lines.append(f"{'ratio ' + v:<20}{a['step_s'] / b['step_s']:>10.3f}{a['peak_bytes'] / b['peak_bytes']:>16.3f}"
                     f"{a['param_bytes'] / b['param_bytes']:>19.3f}   (/ transformers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(BenchConfig()).items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    cfg = BenchConfig(**vars(parser.parse_args(argv)))
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {cfg.dtype!r} must be float32 or bfloat16")
    with tempfile.TemporaryDirectory() as path:
        n_params = save_model(cfg, path)
        results = measure(cfg, path)
    print(table(cfg, n_params, results))


if __name__ == "__main__":
    main()

"""The all-reduce probe of ``hf-dist doctor``: is the collective path healthy and fast, and is any rank slow?

Run on every rank of an initialised process group (NCCL on GPUs, gloo on CPUs). Per message size it times
``iters`` back-to-back all-reduces after ``warmup`` ones and reports, as nccl-tests defines them
(``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests):

* ``time`` -- seconds per all-reduce, measured on each rank and averaged over the ranks;
* ``algbw = size / time`` (bytes per second);
* ``busbw = algbw x 2(n-1)/n`` for all-reduce: the per-link traffic of a ring, comparable to the hardware's
  peak bandwidth whatever the number of ranks.

Before timing, one all-reduce of ``rank + 1`` checks the result (``n(n+1)/2``). A straggler is a rank whose time
exceeds ``1.2 x`` the median over ranks, for either a fixed local matmul (a slow or throttled device) or its
total all-reduce time; ``stragglers()`` is the pure rule.

Not here: starting processes (the launcher does) or the environment report (``hf_dist.doctor.env``).
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

STRAGGLER_FACTOR = 1.2
GPU_SIZES: tuple[int, ...] = tuple(4**k for k in range(5, 15))  # 1 KiB .. 256 MiB
CPU_SIZES: tuple[int, ...] = tuple(4**k for k in range(5, 12))  # 1 KiB .. 4 MiB (gloo over loopback)


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor ``2(n-1)/n``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return 2 * (world_size - 1) / world_size


def stragglers(times: list[float], factor: float = STRAGGLER_FACTOR) -> list[int]:
    """Ranks whose time is more than ``factor x`` the median of ``times``."""
    if not times:
        return []
    median = statistics.median(times)
    return [rank for rank, t in enumerate(times) if t > factor * median]


@dataclass(kw_only=True, frozen=True)
class ProbeRow:
    """One message size."""

    size_bytes: int
    """Bytes per rank in the all-reduce."""
    count: int
    """Elements."""
    dtype: str
    """Element type."""
    time_s: float
    """Seconds per all-reduce, averaged over ranks (nccl-tests' ``time``)."""
    algbw: float
    """Algorithm bandwidth, bytes/s: ``size / time``."""
    busbw: float
    """Bus bandwidth, bytes/s: ``algbw x 2(n-1)/n``."""
    rank_times_s: tuple[float, ...]
    """Each rank's seconds per all-reduce."""


@dataclass(kw_only=True, frozen=True)
class ProbeResult:
    """The probe's findings, identical on every rank."""

    backend: str
    """Process-group backend."""
    world_size: int
    """Ranks."""
    hosts: tuple[str, ...]
    """Host name of each rank."""
    correct: bool
    """The check all-reduce gave ``n(n+1)/2`` on every rank."""
    rows: tuple[ProbeRow, ...]
    """One row per message size, smallest first."""
    compute_times_s: tuple[float, ...]
    """Each rank's seconds for the fixed local matmul."""

    @property
    def compute_stragglers(self) -> list[int]:
        return stragglers(list(self.compute_times_s))

    @property
    def comm_stragglers(self) -> list[int]:
        totals = [sum(row.rank_times_s[r] for row in self.rows) for r in range(self.world_size)]
        return stragglers(totals)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_float(value: float, device: torch.device, group) -> tuple[float, ...]:
    world = dist.get_world_size(group)
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return tuple(float(t.item()) for t in out)


def _check(device: torch.device, group) -> bool:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    t = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(t, group=group)
    ok = torch.tensor([float(bool(torch.all(t == world * (world + 1) / 2)))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item() == 1.0)


def _time_allreduce(size: int, dtype: torch.dtype, iters: int, warmup: int, device, group) -> float:
    count = max(1, size // torch.empty((), dtype=dtype).element_size())
    buf = torch.zeros(count, dtype=dtype, device=device)  # zeros: the sum never overflows, timing is unchanged
    for _ in range(warmup):
        dist.all_reduce(buf, group=group)
    _sync(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf, group=group)
    _sync(device)
    return (time.perf_counter() - start) / iters


def _time_compute(device: torch.device, n: int, iters: int) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    _sync(device)
    return time.perf_counter() - start


def probe_device(backend: str) -> torch.device:
    """The device a rank probes on: its local GPU under NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_probe(
    *,
    sizes: tuple[int, ...] | None = None,
    iters: int | None = None,
    warmup: int | None = None,
    dtype: torch.dtype = torch.float32,
    group=None,
) -> ProbeResult:
    """Run the all-reduce probe on every rank of ``group`` (default: the world); collective."""
    if not dist.is_initialized():
        raise RuntimeError("run_probe needs an initialised process group; start under a launcher (WORLD_SIZE > 1)")
    backend = str(dist.get_backend(group))
    device = probe_device(backend)
    on_gpu = device.type == "cuda"
    sizes = sizes or (GPU_SIZES if on_gpu else CPU_SIZES)
    iters = iters or (20 if on_gpu else 5)
    warmup = 5 if warmup is None and on_gpu else (2 if warmup is None else warmup)
    if iters < 1 or warmup < 0 or any(s < 1 for s in sizes):
        raise ValueError(f"iters={iters} must be >= 1, warmup={warmup} >= 0 and sizes={sizes} positive")
    world = dist.get_world_size(group)
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    correct = _check(device, group)
    compute = _gather_float(_time_compute(device, 2048 if on_gpu else 512, 20 if on_gpu else 5), device, group)
    factor = bus_factor(world)
    rows = []
    for size in sorted(sizes):
        per_rank = _gather_float(_time_allreduce(size, dtype, iters, warmup, device, group), device, group)
        seconds = sum(per_rank) / world
        count = max(1, size // torch.empty((), dtype=dtype).element_size())
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        algbw = nbytes / seconds
        rows.append(ProbeRow(size_bytes=nbytes, count=count, dtype=str(dtype).removeprefix("torch."),
                             time_s=seconds, algbw=algbw, busbw=algbw * factor, rank_times_s=per_rank))
    return ProbeResult(backend=backend, world_size=world, hosts=tuple(hosts), correct=correct, rows=tuple(rows),
                       compute_times_s=compute)


def format_probe(result: ProbeResult) -> str:
    """The nccl-tests-style table, then the health verdict and any straggler warnings."""
    lines = [
        f"all-reduce probe: backend {result.backend}, {result.world_size} ranks on "
        f"{len(set(result.hosts))} host(s); busbw = algbw x 2(n-1)/n = algbw x {bus_factor(result.world_size):.3f}",
        f"{'size(B)':>12} {'count':>10} {'type':>8} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
        f"{'slowest rank':>12}",
    ]
    for row in result.rows:
        slowest = max(range(result.world_size), key=lambda r: row.rank_times_s[r])
        lines.append(f"{row.size_bytes:>12} {row.count:>10} {row.dtype:>8} {row.time_s * 1e6:>10.1f} "
                     f"{row.algbw / 1e9:>12.3f} {row.busbw / 1e9:>12.3f} {slowest:>12}")
    lines.append("result check (sum of rank+1): " + ("ok" if result.correct else "WRONG -- the collective is broken"))
    totals = [sum(row.rank_times_s[r] for row in result.rows) for r in range(result.world_size)]
    for label, times in (("local matmul", result.compute_times_s), ("all-reduce total", totals)):
        median = statistics.median(times)
        for rank in stragglers(list(times)):
            lines.append(f"WARNING: straggler rank {rank} on {result.hosts[rank]}: {label} {times[rank]:.4f}s > "
                         f"{STRAGGLER_FACTOR} x median {median:.4f}s")
    if not result.compute_stragglers and not result.comm_stragglers:
        lines.append(f"no straggler: every rank within {STRAGGLER_FACTOR} x the median of the local matmul and "
                     f"all-reduce times")
    return "\n".join(lines)

"""Tokens/s, MFU and per-rank peak memory, measured between two training logs.

``ThroughputMeter.count(inputs)`` is called once per micro step on every rank; ``report()`` is called on every
rank when the Trainer logs (the Trainer's own loss gathering makes that a collective point already) and returns
the figures to add to the log. Tokens are the tokens the model processed (padding included); ranks of one
tensor/pipeline group process the same tokens, so the cluster figure divides by ``tp x pp``.

MFU = 6 x parameters x tokens / (seconds x devices x peak FLOP/s): the usual dense estimate without the attention
term, so it reads a little low at long context.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

# Peak dense bf16 FLOP/s per device, by a substring of torch.cuda.get_device_name(). Vendor datasheet figures.
_GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
}


def default_peak_flops() -> float | None:
    """The peak dense bf16 FLOP/s of this process's GPU if known; None on CPU or an unknown device."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, flops in _GPU_PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_bytes() -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class ThroughputMeter:
    """Counts tokens per rank and turns them into cluster-wide figures at each log."""

    def __init__(self, *, num_parameters: int, model_parallel: int, peak_flops: float | None) -> None:
        self.num_parameters = num_parameters
        self.model_parallel = model_parallel
        self.peak_flops = peak_flops
        self._tokens = 0
        self._since = time.perf_counter()

    def count(self, inputs: dict) -> None:
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if ids is not None:
            self._tokens += ids.numel()

    def reset(self) -> None:
        self._tokens = 0
        self._since = time.perf_counter()

    def report(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self._since
        local = torch.tensor([float(self._tokens), elapsed, float(peak_memory_bytes())], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        self.reset()
        tokens = sum(t[0].item() for t in gathered) / self.model_parallel
        times = [t[1].item() for t in gathered]
        wall = max(times)
        logs = {"tokens_per_second": tokens / wall if wall > 0 else 0.0}
        if self.peak_flops:
            logs["mfu"] = 6 * self.num_parameters * tokens / (wall * len(gathered) * self.peak_flops)
        for rank, t in enumerate(gathered):
            logs[f"peak_memory_gb/rank{rank}"] = round(t[2].item() / 2**30, 4)
        return logs

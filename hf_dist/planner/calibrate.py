"""Measure the compute efficiency the throughput forecast uses, on the hardware at hand (``hf-dist plan --calibrate``).

``calibrate(model, workload)`` builds the same architecture with fewer layers (``layers``, default 2) from its
config, runs one warm-up and ``steps`` measured training steps (forward, loss, backward, AdamW) of one micro
batch in the workload's precision and activation checkpointing, and returns the fraction of the device peak
the executed FLOPs (``flops.py``, recompute included) ran at. The peak is the GPU catalogue's for a known GPU;
on a CPU or an unknown GPU it is measured: the best of a few large matmuls in the compute dtype.

What it measures is one device's compute efficiency for this model shape; the layout's communication is then
applied by ``throughput.efficiency`` (TP, pipeline bubble, cross-node gathers, offload), as for the assumed
table. ``useful_fraction`` turns a dataset's sequence lengths into the share of non-padding tokens.

Not here: the forecast itself (``throughput.py``) or multi-process runs.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_dist.planner.catalogue import ModelSpec, gpu_from_device_name, spec_config
from hf_dist.planner.layout import Workload
from hf_dist.planner.throughput import flops_per_token


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """A measured compute efficiency and how it was obtained."""

    efficiency: float
    """Executed FLOP/s over the device peak."""
    step_time_s: float
    """Mean seconds per measured training step of the scaled-down model."""
    peak_flops: float
    """The device peak used."""
    source: str
    """One line saying what ran where."""


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The device's peak FLOP/s and where it comes from (catalogue, or a measured matmul)."""
    if device.type == "cuda":
        spec = gpu_from_device_name(torch.cuda.get_device_name(device))
        if spec is not None:
            return spec.peak_bf16_flops, f"{spec.name} datasheet"
    n = 1024 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best, f"measured {n}x{n} {str(dtype).removeprefix('torch.')} matmul"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _scaled_model(model: ModelSpec, layers: int, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    config = spec_config(model).__class__.from_dict(spec_config(model).to_dict())
    config.num_hidden_layers = layers
    built = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    built.train()
    return built


def calibrate(model: ModelSpec, workload: Workload, *, layers: int = 2, steps: int = 3,
              device: torch.device | str | None = None) -> Calibration:
    """Measure the compute efficiency of ``model`` (scaled to ``layers``) under ``workload`` on ``device``."""
    if layers < 1 or steps < 1:
        raise ValueError(f"layers={layers} and steps={steps} must be positive")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = workload.precision in ("bf16_mixed", "pure_bf16") and device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    scaled = dataclasses.replace(model, num_hidden_layers=min(layers, model.num_hidden_layers))
    net = _scaled_model(model, scaled.num_hidden_layers, dtype, device)
    if workload.activation_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    ids = torch.randint(0, model.vocab_size, (workload.micro_batch_size, workload.seq_len), device=device)
    autocast = workload.precision == "bf16_autocast" and device.type == "cuda"
    times = []
    for step in range(steps + 1):  # the first step warms up (allocations, kernels)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step:
            times.append(time.perf_counter() - start)
    step_time = sum(times) / len(times)
    _, executed = flops_per_token(scaled, workload)
    peak, peak_source = device_peak_flops(device, dtype)
    eff = executed * workload.tokens / (step_time * peak)
    source = (f"calibrated: {steps} steps of a {scaled.num_hidden_layers}-layer {model.name} on {device.type} "
              f"({peak / 1e12:.2f} TFLOP/s peak, {peak_source}), micro batch {workload.micro_batch_size} x "
              f"{workload.seq_len} tokens")
    return Calibration(efficiency=eff, step_time_s=step_time, peak_flops=peak, source=source)


def read_lengths(path: str | Path) -> list[int]:
    """Sequence lengths from a JSON list or a text file with one integer per line."""
    text = Path(path).read_text(encoding="utf-8").strip()
    try:
        values = json.loads(text) if text.startswith("[") else [int(x) for x in text.split()]
    except ValueError as err:
        raise ValueError(f"{path}: expected a JSON list of lengths or one integer per line ({err})") from None
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{path}: lengths must be positive integers, and at least one")
    return values


def useful_fraction(lengths: list[int], seq_len: int) -> float:
    """The share of non-padding tokens when every sequence is padded (or cut) to ``seq_len``."""
    return sum(min(n, seq_len) for n in lengths) / (len(lengths) * seq_len)


__all__ = ["Calibration", "calibrate", "device_peak_flops", "read_lengths", "useful_fraction"]

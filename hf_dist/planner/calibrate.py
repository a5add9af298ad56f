"""Measure the compute efficiency the throughput forecast uses, on the hardware at hand (``hf-dist plan --calibrate``).

``calibrate(model, workload)`` builds the same architecture with fewer layers (``layers``, default 2) from its
config, runs one warm-up and ``steps`` measured training steps (forward, loss, backward, AdamW) of one micro
batch in the workload's precision and activation checkpointing, and returns the fraction of the device peak
the executed FLOPs (``flops.py``, recompute included) ran at. The peak is the GPU catalogue's for a known GPU;
on a CPU or an unknown GPU it is measured: the best of a few large matmuls in the compute dtype.

What it measures is one device's compute efficiency for this model shape; the forecast then adds the layout's
communication time (the ledger minimum's bytes over the links, ``communication.py``) and applies the pipeline
bubble and offload factors (``throughput.efficiency``), as for the assumed efficiency. This is the fallback: with more than one device or rank, ``hf-dist plan --calibrate`` runs the chosen
layout's parallelism across real processes instead (``hf_dist.cli.calibrate_ranks``, on the layout
``calibration_layout`` scales to the ranks at hand), and ``Calibration.source`` says which of the two ran.
``useful_fraction`` turns a dataset's sequence lengths into the share of non-padding tokens.

Not here: the forecast itself (``throughput.py``) or starting processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_dist.planner.catalogue import ModelSpec, gpu_from_device_name, spec_config
from hf_dist.planner.workload import Layout, Workload
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
    ranks: int = 1
    """Processes that ran: 1 is the one-device path (compute only); more: real collectives, which the measured step
    time then includes."""
    measured_tp: int = 1
    """The TP degree whose collectives the measured step time includes (1: none)."""
    local_parameters: int = 0
    """Parameter elements rank 0 held after the layout was applied (its shard under FSDP2/TP); 0: one device."""


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


def scaled_model(model: ModelSpec, layers: int, dtype: torch.dtype, device: torch.device):
    """``model``'s architecture with ``layers`` decoder layers, built from its config (random weights, train mode)."""
    from transformers import AutoModelForCausalLM

    config = spec_config(model).__class__.from_dict(spec_config(model).to_dict())
    config.num_hidden_layers = layers
    built = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    built.train()
    return built


def timed_steps(net: torch.nn.Module, ids: torch.Tensor, *, steps: int, autocast: bool) -> list[float]:
    """Seconds of each of ``steps`` training steps (forward, loss, backward, AdamW) after one warm-up step."""
    device = ids.device
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
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
    return times


def compute_dtypes(workload: Workload, device: torch.device, *, fsdp: bool = False) -> tuple[torch.dtype,
                                                                                                torch.dtype | None, bool]:
    """``(model dtype, FSDP2 param_dtype, autocast)`` of ``workload``'s precision as it runs on ``device``.

    On a CPU everything runs in fp32 (bf16 is slower than fp32 there and would not say what a GPU does). On a
    GPU ``bf16_mixed`` is FSDP2's fp32 model computing in bf16 parameters, or a bf16 model elsewhere.
    """
    if device.type != "cuda" or workload.precision == "fp32":
        return torch.float32, None, False
    if workload.precision == "bf16_autocast":
        return torch.float32, None, True
    if workload.precision == "bf16_mixed" and fsdp:
        return torch.float32, torch.bfloat16, False
    return torch.bfloat16, None, False


def calibration_layout(layout: Layout, ranks: int) -> Layout:
    """The chosen ``layout`` scaled to ``ranks`` processes on one node, for a measured calibration.

    TP keeps the largest degree dividing both (``gcd``; it divides the heads since ``layout.tp`` does); the
    data-parallel ranks are the rest. Pipeline stages, offload and LoRA are not run: the bubble and offload are
    applied by ``throughput.efficiency`` and LoRA's FLOPs are not what is calibrated. ZeRO runs as its FSDP2
    counterpart with the same collectives (ZeRO-3: FULL_SHARD; ZeRO-1/2: SHARD_GRAD_OP), and HYBRID_SHARD on one
    node as FULL_SHARD.
    """
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be positive")
    tp = math.gcd(layout.tp, ranks)
    strategy = {"zero3": "fsdp_full_shard", "zero1": "fsdp_shard_grad_op", "zero2": "fsdp_shard_grad_op",
                "fsdp_hybrid_shard": "fsdp_full_shard"}.get(layout.strategy, layout.strategy)
    return Layout(strategy=strategy, num_gpus=ranks, tp=tp,
                  sequence_parallel=layout.sequence_parallel and tp > 1,
                  vocab_parallel=layout.vocab_parallel and tp > 1)


def efficiency_from(model: ModelSpec, workload: Workload, *, layers: int, tokens: int, step_time_s: float,
                    peak_flops: float) -> float:
    """Executed FLOP/s of ``tokens`` per step on the ``layers``-layer model, over ``peak_flops`` (all ranks)."""
    scaled = dataclasses.replace(model, num_hidden_layers=min(layers, model.num_hidden_layers))
    _, executed = flops_per_token(scaled, workload)
    return executed * tokens / (step_time_s * peak_flops)


def calibrate(model: ModelSpec, workload: Workload, *, layers: int = 2, steps: int = 3,
              device: torch.device | str | None = None, note: str = "") -> Calibration:
    """Measure the compute efficiency of ``model`` (scaled to ``layers``) under ``workload`` on one ``device``.

    ``note`` is added to the source line (why the one-device path ran).
    """
    if layers < 1 or steps < 1:
        raise ValueError(f"layers={layers} and steps={steps} must be positive")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype, _, autocast = compute_dtypes(workload, device)
    layers = min(layers, model.num_hidden_layers)
    net = scaled_model(model, layers, dtype, device)
    if workload.activation_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.vocab_size, (workload.micro_batch_size, workload.seq_len), device=device)
    times = timed_steps(net, ids, steps=steps, autocast=autocast)
    step_time = sum(times) / len(times)
    peak, peak_source = device_peak_flops(device, dtype)
    eff = efficiency_from(model, workload, layers=layers, tokens=workload.tokens, step_time_s=step_time,
                          peak_flops=peak)
    source = (f"calibrated on one device (compute only; communication timed from its bytes{note}): {steps} steps of a {layers}-layer "
              f"{model.name} on {device.type} ({peak / 1e12:.2f} TFLOP/s peak, {peak_source}), micro batch "
              f"{workload.micro_batch_size} x {workload.seq_len} tokens")
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


__all__ = [
    "Calibration", "calibrate", "calibration_layout", "compute_dtypes", "device_peak_flops", "efficiency_from",
    "read_lengths", "scaled_model", "timed_steps", "useful_fraction",
]

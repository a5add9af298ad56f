"""Step time, tokens/s and wall-clock time: compute time from FLOPs, communication time from the ledger minimum.

FLOPs per token: ``flops.py`` (the one formula, shared with the trainer's runtime MFU): ``6·P`` per trainable
and ``4·P`` per frozen matmul weight, ``12·L·s·q_dim`` for attention, and the forward again under activation
checkpointing, executed but not counted in MFU.

``compute_s = executed FLOPs per step per GPU / (peak x efficiency)``. The efficiency is a compute efficiency times
the layout's offload and pipeline-bubble factors (``efficiency``). The compute efficiency is either measured
(``calibrate.py``, ``hf-dist plan --calibrate``) or, without calibration, ``ASSUMED_EFFICIENCY``, and
``Throughput.efficiency_source`` says which. One constant cannot describe both an unoptimised Trainer run (a few %
MFU) and a tuned stack (55-73 %, ``bench/planner_anchors.py``).

``communication_s``: the bytes one rank must move in the step by the ledger minimum's definition
(``hf_dist.metrics.ledger_minimum.layout_minimum``: DP all-reduce, FSDP2/ZeRO gathers and reduce-scatters, TP
all-reduces, PP sends, EP dispatch/combine and CP all-to-alls) over the bandwidth of the link each group runs on,
intra- or inter-node (``communication.py``).

``step_time_s = max(compute_s, data-parallel communication) + TP/PP/EP/CP communication``: the data-parallel
collectives (FSDP2's prefetched gathers, reduce-scatters and DDP's bucketed all-reduce during backward) overlap
compute, the model-parallel ones sit between the computations that need them (``Communication.overlappable_s`` /
``exposed_s``). The bandwidths are the links' peaks, so the communication time is a lower bound for the bytes.
Check: torchtitan's Llama-2-13B on 64 A100s (FSDP2 across 8 nodes at 25 GB/s per GPU) publishes 1,904 tokens/s/GPU;
at its stack's 55.2 % efficiency the forecast is 1,975 (+3.7 %) with overlap (4.15 s of compute hide 4.10 s of
gathers and reduce-scatters) and 993 (-48 %) without (``tests/test_planner_step.py``). MFU = model FLOPs (without recompute) of the useful (non-padding) tokens / (time x
peak).

Not here: memory (``memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist.planner.catalogue import GpuSpec, ModelSpec
from hf_dist.planner.communication import Communication, Links, communication
from hf_dist.planner.flops import FlopCounts
from hf_dist.planner.workload import Layout, Workload

ASSUMED_EFFICIENCY = 0.50
"""Fraction of peak the executed FLOPs run at when not calibrated, communication excluded (it is timed on its own):
what the old per-strategy table gave DDP, whose collectives are the smallest, on NVLink nodes."""
ASSUMED_SOURCE = "assumed (planner ASSUMED_EFFICIENCY), not measured"
OFFLOAD_FACTOR = {"none": 1.0, "cpu_optimizer": 0.50, "cpu": 0.40, "nvme": 0.25}
"""Optimizer step on the CPU and PCIe traffic."""


@dataclass(kw_only=True, frozen=True)
class Throughput:
    """Time per optimizer step and the rates that follow."""

    model_flops_per_token: float
    """Forward + backward FLOPs per token, without recompute (the MFU numerator)."""
    executed_flops_per_token: float
    """Including activation-checkpointing recompute."""
    efficiency: float
    """Fraction of peak achieved on executed FLOPs."""
    efficiency_source: str = ASSUMED_SOURCE
    """Where the efficiency comes from: the stated assumption, a calibration run, or the caller."""
    compute_s: float
    """Seconds of compute per optimizer step: executed FLOPs per GPU / (peak x efficiency)."""
    communication: Communication
    """The ledger minimum's rows for one rank, timed per link class."""
    step_time_s: float
    """Seconds per optimizer step (global batch): ``max(compute_s, overlappable) + exposed`` communication."""
    tokens_per_s: float
    """Cluster-wide training tokens per second (padding included)."""
    useful_tokens_per_s: float = 0.0
    """Cluster-wide non-padding tokens per second."""
    mfu: float
    """Model FLOPs utilisation (of the useful tokens)."""

    @property
    def communication_s(self) -> float:
        """Seconds of communication per optimizer step (the ledger minimum over the links)."""
        return self.communication.seconds

    def wall_clock_s(self, tokens: float) -> float:
        """Seconds to train on ``tokens`` tokens."""
        return tokens / self.tokens_per_s


def flop_counts(model: ModelSpec, *, lora_rank: int = 0) -> FlopCounts:
    """``FlopCounts`` of ``model`` (the formula in ``flops.py``, shared with the trainer's runtime MFU)."""
    # a MoE token passes through its k experts only: FLOPs on the active weights (router included)
    weights = model.num_hidden_layers * model.layer_active_linear_weights + model.vocab_size * model.hidden_size
    adapters = model.num_hidden_layers * model.lora_params_per_layer(lora_rank) if lora_rank else 0
    return FlopCounts(trainable_matmul=adapters or weights, frozen_matmul=weights if lora_rank else 0,
                      layers=model.num_hidden_layers, q_dim=model.q_dim)


def flops_per_token(model: ModelSpec, workload: Workload, *, lora_rank: int = 0) -> tuple[float, float]:
    """``(model FLOPs, executed FLOPs)`` per token; a frozen reference model's forward is executed, not counted in
    the model FLOPs (MFU)."""
    counts = flop_counts(model, lora_rank=lora_rank)
    model_flops, executed = counts.per_token(workload.seq_len, recompute=workload.activation_checkpointing)
    return model_flops, executed + (counts.forward(workload.seq_len) if workload.reference_model else 0.0)


def efficiency(layout: Layout, *, accumulation: int, base: float | None = None) -> float:
    """The efficiency of ``layout``'s compute: ``base`` (a calibrated or stated compute efficiency; default
    ``ASSUMED_EFFICIENCY``) times its offload factor and, under PP, the 1F1B bubble's share of busy time.
    Communication is not a factor: it is timed from its bytes (``communication.py``)."""
    eff = (ASSUMED_EFFICIENCY if base is None else base) * OFFLOAD_FACTOR[layout.offload]
    if layout.dims.pp > 1:  # the 1F1B bubble
        eff *= accumulation / (accumulation + layout.dims.pp - 1)
    return eff


def estimate_throughput(model: ModelSpec, workload: Workload, layout: Layout, gpu: GpuSpec, *,
                        links: Links | None = None, base_efficiency: float | None = None,
                        efficiency_source: str | None = None, useful_fraction: float = 1.0) -> Throughput:
    """Compute, communication and step time and the rates on ``layout``; the global batch is micro x dp x
    ``workload`` accumulation.

    ``links``: the bandwidths (default: the GPU kind's, ``gpus.py``); ``base_efficiency`` replaces the assumed
    compute efficiency (``hf-dist plan --calibrate`` measures it); ``useful_fraction`` is the share of non-padding
    tokens (from a dataset's lengths), for useful tokens/s.
    """
    if not 0 < useful_fraction <= 1:
        raise ValueError(f"useful_fraction={useful_fraction} must be in (0, 1]")
    model_flops, executed = flops_per_token(model, workload, lora_rank=layout.lora_rank)
    accumulation = workload.gradient_accumulation_steps
    tokens = workload.tokens * layout.dims.dp * accumulation
    eff = efficiency(layout, accumulation=accumulation, base=base_efficiency)
    world = layout.dims.world_size
    compute = executed * tokens / (world * gpu.peak_bf16_flops * eff)
    comm = communication(model, workload, layout, links or Links.of(gpu))
    step = max(compute, comm.overlappable_s) + comm.exposed_s
    source = efficiency_source or (ASSUMED_SOURCE if base_efficiency is None else "given")
    return Throughput(model_flops_per_token=model_flops, executed_flops_per_token=executed, efficiency=eff,
                      efficiency_source=source, compute_s=compute, communication=comm, step_time_s=step,
                      tokens_per_s=tokens / step, useful_tokens_per_s=useful_fraction * tokens / step,
                      mfu=useful_fraction * model_flops * tokens / (step * world * gpu.peak_bf16_flops))

"""Step time, tokens/s and wall-clock time from FLOPs, the device peak and a stated efficiency per layout.

FLOPs per token: ``flops.py`` (the one formula, shared with the trainer's runtime MFU): ``6·P`` per trainable
and ``4·P`` per frozen matmul weight, ``12·L·s·q_dim`` for attention, and the forward again under activation
checkpointing, executed but not counted in MFU.

``step_time = executed FLOPs per step per GPU / (peak x efficiency)``. The efficiency is a base compute
efficiency times the layout's factors below (offload, TP, pipeline bubble, cross-node gathers). The base is
either measured (``calibrate.py``, ``hf-dist plan --calibrate``) or, without calibration, the assumption in
``BASE_EFFICIENCY`` (typical of published HF/FSDP/DeepSpeed runs on NVLink nodes), and ``Throughput.
efficiency_source`` says which. One constant cannot describe both an unoptimised Trainer run (a few % MFU) and
a tuned stack (55-73 %, ``bench/planner_anchors.py``). MFU = model FLOPs (without recompute) of the useful
(non-padding) tokens / (time x peak).

Context parallelism adds its all-to-all time to the step (``cp_all_to_all_s``): per layer, q, k, v and the
attention output are exchanged in the forward, again in the backward, and once more in a recomputed forward;
each rank sends ``(cp - 1)/cp`` of its slice at ``CP_ALL_TO_ALL_BYTES_PER_S`` (an assumption, not measured).

Not here: memory (``memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist.planner.catalogue import GpuSpec, ModelSpec
from hf_dist.planner.flops import FlopCounts
from hf_dist.planner.workload import Layout, Workload

BASE_EFFICIENCY: dict[str, float] = {
    "ddp": 0.50,
    "zero1": 0.48,
    "zero2": 0.45,
    "fsdp_shard_grad_op": 0.45,
    "fsdp_hybrid_shard": 0.42,
    "fsdp_full_shard": 0.42,
    "zero3": 0.40,
}
"""Fraction of peak the executed FLOPs run at, by data-parallel flavour (one node)."""
TP_FACTOR = 0.90
"""Per-layer TP all-reduces inside a node."""
CROSS_NODE_SHARD_FACTOR = 0.85
"""FULL_SHARD / ZeRO-3 gathering parameters across nodes every layer."""
OFFLOAD_FACTOR = {"none": 1.0, "cpu_optimizer": 0.50, "cpu": 0.40, "nvme": 0.25}
"""Optimizer step on the CPU and PCIe traffic."""
CP_ALL_TO_ALL_BYTES_PER_S = 100e9
"""Assumed all-to-all bandwidth per GPU inside an NVLink node (a fraction of the link's peak: all-to-all has many
small peers)."""


@dataclass(kw_only=True, frozen=True)
class Throughput:
    """Time per optimizer step and the rates that follow."""

    model_flops_per_token: float
    """Forward + backward FLOPs per token, without recompute (the MFU numerator)."""
    executed_flops_per_token: float
    """Including activation-checkpointing recompute."""
    efficiency: float
    """Fraction of peak achieved on executed FLOPs."""
    efficiency_source: str = "assumed (planner BASE_EFFICIENCY table), not measured"
    """Where the efficiency comes from: the stated table, a calibration run, or the caller."""
    step_time_s: float
    """Seconds per optimizer step (global batch)."""
    tokens_per_s: float
    """Cluster-wide training tokens per second (padding included)."""
    useful_tokens_per_s: float = 0.0
    """Cluster-wide non-padding tokens per second."""
    mfu: float
    """Model FLOPs utilisation (of the useful tokens)."""

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
    """``(model FLOPs, executed FLOPs)`` per token."""
    return flop_counts(model, lora_rank=lora_rank).per_token(workload.seq_len,
                                                             recompute=workload.activation_checkpointing)


def efficiency(layout: Layout, *, gpus_per_node: int, accumulation: int, base: float | None = None,
               measured_tp: int = 1) -> float:
    """The efficiency of ``layout``: ``base`` (a calibrated or stated compute efficiency; default the
    ``BASE_EFFICIENCY`` of its strategy) times its offload, TP, pipeline-bubble and cross-node factors.
    ``measured_tp > 1``: ``base`` was measured with real TP collectives, so ``TP_FACTOR`` is not applied again."""
    eff = (BASE_EFFICIENCY[layout.strategy] if base is None else base) * OFFLOAD_FACTOR[layout.offload]
    if layout.dims.tp > 1 and measured_tp == 1:
        eff *= TP_FACTOR
    if layout.dims.pp > 1:  # the 1F1B bubble
        eff *= accumulation / (accumulation + layout.dims.pp - 1)
    if layout.strategy in ("fsdp_full_shard", "zero3") and layout.shard_degree > gpus_per_node:
        eff *= CROSS_NODE_SHARD_FACTOR
    return eff


def cp_all_to_all_s(model: ModelSpec, workload: Workload, layout: Layout) -> float:
    """Seconds per optimizer step one rank spends in context-parallel all-to-alls (0 without CP)."""
    cp = layout.dims.cp
    if cp == 1:
        return 0.0
    element = 4 if workload.precision == "fp32" else 2
    exchanged = element * workload.tokens // cp * (2 * model.q_dim + 2 * model.kv_dim // max(1, layout.dims.tp))
    passes = 3 if workload.activation_checkpointing else 2
    sent = exchanged * (cp - 1) / cp * passes * model.num_hidden_layers * workload.gradient_accumulation_steps
    return sent / CP_ALL_TO_ALL_BYTES_PER_S


def estimate_throughput(model: ModelSpec, workload: Workload, layout: Layout, gpu: GpuSpec, *,
                        gpus_per_node: int = 8, base_efficiency: float | None = None,
                        efficiency_source: str | None = None, useful_fraction: float = 1.0,
                        measured_tp: int = 1) -> Throughput:
    """Step time and rates on ``layout``; the global batch is micro x dp x ``workload`` accumulation.

    ``base_efficiency`` replaces the strategy's assumed one (``hf-dist plan --calibrate`` measures it);
    ``useful_fraction`` is the share of non-padding tokens (from a dataset's lengths), for useful tokens/s;
    ``measured_tp`` as in ``efficiency``.
    """
    if not 0 < useful_fraction <= 1:
        raise ValueError(f"useful_fraction={useful_fraction} must be in (0, 1]")
    model_flops, executed = flops_per_token(model, workload, lora_rank=layout.lora_rank)
    accumulation = workload.gradient_accumulation_steps
    tokens = workload.tokens * layout.dims.dp * accumulation
    eff = efficiency(layout, gpus_per_node=gpus_per_node, accumulation=accumulation, base=base_efficiency,
                     measured_tp=measured_tp)
    world = layout.dims.world_size
    step = executed * tokens / (world * gpu.peak_bf16_flops * eff) + cp_all_to_all_s(model, workload, layout)
    source = efficiency_source or ("assumed: BASE_EFFICIENCY table (typical published runs), not measured"
                                   if base_efficiency is None else "given")
    return Throughput(model_flops_per_token=model_flops, executed_flops_per_token=executed, efficiency=eff,
                      efficiency_source=source, step_time_s=step, tokens_per_s=tokens / step,
                      useful_tokens_per_s=useful_fraction * tokens / step,
                      mfu=useful_fraction * model_flops * tokens / (step * world * gpu.peak_bf16_flops))

"""The inputs of a memory estimate: what is trained (``Workload``) and how it is laid out (``Layout``).

``Workload`` is the per-rank training setup: sequence length, micro batch, precision, attention kernel and
activation checkpointing. ``Layout`` is a parallel layout: the data-parallel flavour (DDP, ZeRO-1/2/3, FSDP),
its ``ParallelDims`` (TP, PP, shard and replicate degrees), offload and LoRA. ``make_layout`` builds the dims
each strategy implies from a world size.

Precision presets (what sits in memory):
  * ``fp32``: parameters, gradients and Adam states in fp32; compute in fp32.
  * ``bf16_autocast``: fp32 parameters (they are the master copy), fp32 gradients and Adam states; matmuls run
    in bf16 under ``torch.autocast`` (the case study's ``torch.cuda.amp.autocast`` and the HF Trainer's
    ``bf16=True``). The residual stream stays fp32; FSDP/ZeRO-3 gather fp32 units.
  * ``bf16_mixed``: the module computes in bf16 with an fp32 master copy: FSDP ``MixedPrecision`` /
    ``MixedPrecisionPolicy(param_dtype=bf16)`` (fp32 shards, bf16 gathered units, bf16 residual stream) or
    DeepSpeed ``bf16`` (bf16 module parameters and gradients, fp32 master and Adam in the optimizer).
DeepSpeed strategies always use DeepSpeed's layout: bf16 module with fp32 master unless precision is fp32.

Not here: the arithmetic (``memory.py``, ``activations.py``) or which layout to pick (``chooser.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hf_dist.parallel_dims import ParallelDims

Strategy = Literal["ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard"]
STRATEGIES: tuple[str, ...] = (
    "ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard",
)
FSDP_STRATEGIES = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid_shard")
ZERO_STRATEGIES = ("zero1", "zero2", "zero3")
Precision = Literal["fp32", "bf16_autocast", "bf16_mixed"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16_autocast", "bf16_mixed")
Attention = Literal["eager", "sdpa", "flash"]
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")
Offload = Literal["none", "cpu", "nvme"]


@dataclass(kw_only=True, frozen=True)
class Workload:
    """What one data-parallel rank runs per micro step."""

    seq_len: int
    """Tokens per sequence."""
    micro_batch_size: int = 1
    """Sequences per forward on one data-parallel rank."""
    precision: Precision = "bf16_autocast"
    """Which tensors are fp32 and which bf16 (see the module docstring)."""
    attention: Attention = "sdpa"
    """``eager`` keeps the (b, heads, s, s) probabilities; ``sdpa``/``flash`` keep only a (b, heads, s) logsumexp."""
    activation_checkpointing: bool = True
    """Per decoder layer (HF ``gradient_checkpointing_enable``, non-reentrant)."""
    gradient_accumulation_steps: int = 1
    """Micro steps per optimizer step (bounds the micro batches a pipeline holds in flight)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not known; use one of {', '.join(PRECISIONS)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r} is not known; use one of {', '.join(ATTENTIONS)}")

    @property
    def tokens(self) -> int:
        """Tokens per micro batch (N = b x s)."""
        return self.seq_len * self.micro_batch_size


@dataclass(kw_only=True, frozen=True)
class Layout:
    """A parallel layout for one job."""

    strategy: Strategy
    """Data-parallel flavour; with TP/PP it names the data-parallel part."""
    dims: ParallelDims
    """How the world is factored (``dp_shard`` is what FSDP shards over; ZeRO shards over all of ``dp``)."""
    offload: Offload = "none"
    """ZeRO: optimizer states (ZeRO-3: also parameters) to CPU or NVMe. FSDP FULL_SHARD: ``cpu`` only."""
    lora_rank: int = 0
    """LoRA rank on all seven linears of every layer over a frozen base; 0: full fine-tune."""
    sequence_parallel: bool = False
    """With TP: norms and residual-stream activations are split over TP ranks too."""
    tp_vocab_parallel: bool = True
    """With TP: embedding and lm_head are split over the vocabulary; False: replicated on every TP rank."""

    def __post_init__(self) -> None:
        d = self.dims
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not known; use one of {', '.join(STRATEGIES)}")
        if self.strategy == "ddp" and d.dp_shard != 1:
            raise ValueError(f"strategy='ddp' replicates: dims.dp_shard={d.dp_shard} must be 1 (use dp_replicate)")
        if self.strategy in (*ZERO_STRATEGIES, "fsdp_full_shard", "fsdp_shard_grad_op") and d.dp_replicate != 1:
            raise ValueError(f"strategy={self.strategy!r} shards over all data-parallel ranks: dims.dp_replicate="
                             f"{d.dp_replicate} must be 1; use fsdp_hybrid_shard to replicate across nodes")
        if self.strategy in ZERO_STRATEGIES and (d.tp > 1 or d.pp > 1):
            raise ValueError(f"strategy={self.strategy!r} with tp={d.tp}, pp={d.pp}: hf_dist combines TP/PP with "
                             f"DDP or FSDP only; use ddp or an fsdp_* strategy for the data-parallel part")
        if self.offload not in ("none", "cpu", "nvme"):
            raise ValueError(f"offload={self.offload!r} is not known; use none, cpu or nvme")
        if self.offload != "none" and self.strategy not in (*ZERO_STRATEGIES, "fsdp_full_shard"):
            raise ValueError(f"offload={self.offload!r} needs a ZeRO strategy or fsdp_full_shard, "
                             f"not strategy={self.strategy!r}")
        if self.offload == "nvme" and self.strategy not in ZERO_STRATEGIES:
            raise ValueError(f"offload='nvme' is DeepSpeed's (ZeRO-Infinity); strategy={self.strategy!r} "
                             f"can offload to cpu only")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r} must be a non-negative integer (0: no LoRA)")
        if self.sequence_parallel and d.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1 (it splits activations over TP ranks)")

    @property
    def shard_degree(self) -> int:
        """Ranks that model states are sharded over (1: replicated)."""
        if self.strategy in ZERO_STRATEGIES:
            return self.dims.dp
        if self.strategy in FSDP_STRATEGIES:
            return self.dims.dp_shard
        return 1

    @property
    def is_deepspeed(self) -> bool:
        return self.strategy in ZERO_STRATEGIES

    @property
    def name(self) -> str:
        """Short label, e.g. ``fsdp_full_shard+tp4``, ``zero3+offload_cpu``, ``ddp+lora16``."""
        parts = [self.strategy]
        if self.dims.tp > 1:
            parts.append(f"tp{self.dims.tp}" + ("sp" if self.sequence_parallel else ""))
        if self.dims.pp > 1:
            parts.append(f"pp{self.dims.pp}")
        if self.offload != "none":
            parts.append(f"offload_{self.offload}")
        if self.lora_rank:
            parts.append(f"lora{self.lora_rank}")
        return "+".join(parts)


def make_layout(strategy: Strategy, world_size: int, *, tp: int = 1, pp: int = 1, gpus_per_node: int = 8,
                **layout_kwargs) -> Layout:
    """The layout ``strategy`` implies on ``world_size`` ranks with ``tp`` x ``pp`` model parallelism.

    DDP replicates over the data-parallel ranks; ZeRO, FULL_SHARD and SHARD_GRAD_OP shard over all of them;
    HYBRID_SHARD shards inside a node (``gpus_per_node / tp`` ranks) and replicates across nodes.
    """
    if world_size % (tp * pp):
        raise ValueError(f"tp={tp} x pp={pp} does not divide world_size={world_size}; pick tp, pp dividing it")
    dp = world_size // (tp * pp)
    if strategy == "ddp":
        dims = ParallelDims(world_size=world_size, tp=tp, pp=pp, dp_replicate=dp, dp_shard=1)
    elif strategy == "fsdp_hybrid_shard":
        shard = max(1, min(dp, gpus_per_node // tp))
        if dp % shard:
            raise ValueError(f"fsdp_hybrid_shard: data-parallel size {dp} is not a multiple of the in-node shard "
                             f"size {shard} (gpus_per_node={gpus_per_node} / tp={tp}); use whole nodes")
        dims = ParallelDims(world_size=world_size, tp=tp, pp=pp, dp_replicate=dp // shard, dp_shard=shard)
    else:
        dims = ParallelDims(world_size=world_size, tp=tp, pp=pp, dp_replicate=1, dp_shard=dp)
    return Layout(strategy=strategy, dims=dims, **layout_kwargs)

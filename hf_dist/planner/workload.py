"""The inputs of a memory estimate: what is trained (``Workload``) and how it is laid out (``Layout``).

``Workload`` is the per-rank training setup: sequence length, micro batch, precision, attention kernel and
activation checkpointing. ``Layout`` is ``hf_dist.strategy``'s, shared with config
generation and the trainer; ``make_layout`` builds one from a world size.

Precision presets (what sits in memory; ``hf_dist.precision.precision_that_runs`` says which one a layout runs;
``hf_dist.precision.tensor_dtypes`` the dtype of each tensor class):
  * ``fp32``: parameters, gradients and Adam states in fp32; compute in fp32.
  * ``bf16_autocast``: fp32 parameters (they are the master copy), fp32 gradients and Adam states; matmuls run
    in bf16 under ``torch.autocast`` (the HF Trainer's ``bf16=True`` with DDP). The residual stream stays fp32.
  * ``bf16_mixed``: the module computes in bf16 with an fp32 master copy: FSDP2
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 shards, bf16 gathered units, bf16
    residual stream, fp32 reduce-scatter) or DeepSpeed ``bf16`` (bf16 module parameters and gradients, fp32
    master and Adam in the optimizer).
  * ``pure_bf16``: a model loaded in bf16 with no fp32 copy: bf16 parameters, gradients and Adam states
    (8 bytes/parameter); what pipeline stages run with ``--bf16``.

Not here: the arithmetic (``memory.py``, ``activations.py``) or which layout to pick (``chooser.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hf_dist.precision import PRECISIONS, Precision  # noqa: F401 -- re-exported for the planner
from hf_dist.strategy import (  # noqa: F401 -- re-exported for the planner
    FSDP_STRATEGIES,
    STRATEGIES,
    ZERO_STRATEGIES,
    Layout,
    Strategy,
)

Attention = Literal["eager", "sdpa", "flash"]
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")


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
    """Per decoder layer (HF ``activation_checkpointing_enable``, non-reentrant)."""
    gradient_accumulation_steps: int = 1
    """Micro steps per optimizer step (bounds the micro batches a pipeline holds in flight)."""
    chunked_loss: bool = False
    """The loss through the head chunk by chunk (``hf_dist.loss``, DistTrainer's default where exact): one chunk of
    logits at a time, never ``N x V``. Ignored under vocabulary-parallel TP, which has its own loss."""
    reference_model: bool = False
    """A frozen reference model runs a no-grad forward beside the policy (TRL's DPO; GRPO with ``beta > 0``): its
    parameters stored and sharded like the policy's, no gradients or optimizer state; under LoRA it is the policy
    with its adapters disabled and holds nothing more."""
    generation_sequences: int = 0
    """Sequences this rank generates at once (GRPO's completions): a KV cache of ``seq_len`` tokens each."""
    head_unit: bool = True
    """Under FSDP an untied lm_head is a unit of its own (DistTrainer); TRL's trainers keep it in the root, gathered
    through the step (their fused LM head reads its weight in the root's forward; ``hf_dist.parallelism``)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.generation_sequences, int) or self.generation_sequences < 0:
            raise ValueError(f"generation_sequences={self.generation_sequences!r} must be a non-negative integer")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not known; use one of {', '.join(PRECISIONS)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r} is not known; use one of {', '.join(ATTENTIONS)}")

    @property
    def tokens(self) -> int:
        """Tokens per micro batch (N = b x s)."""
        return self.seq_len * self.micro_batch_size


def make_layout(strategy: Strategy, world_size: int, *, tp: int = 1, pp: int = 1, gpus_per_node: int = 8,
                **layout_kwargs) -> Layout:
    """The ``Layout`` of ``strategy`` on ``world_size`` ranks: one node when ``world_size <= gpus_per_node``,
    else whole nodes of ``gpus_per_node``."""
    if world_size <= gpus_per_node:
        num_gpus, num_nodes = world_size, 1
    elif world_size % gpus_per_node:
        raise ValueError(f"world_size={world_size} is not a whole number of nodes of gpus_per_node={gpus_per_node}")
    else:
        num_gpus, num_nodes = gpus_per_node, world_size // gpus_per_node
    return Layout(strategy=strategy, num_gpus=num_gpus, num_nodes=num_nodes, tp=tp, pp=pp, **layout_kwargs)

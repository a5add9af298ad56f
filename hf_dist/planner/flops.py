"""The one FLOP formula for training a decoder-only LM: used by the planner's forecast and the trainer's runtime MFU.

Per token, forward + backward, dense (causal masking not discounted), with ``s`` the sequence length:
  * matmul weights: ``P`` counts what one token passes through -- a MoE's routed experts (the 3-D
    ``mlp.experts.*`` weights, and PEFT's per-expert adapters on them) times ``k / E``
    (``num_experts_per_tok / num_local_experts``: the active parameters), their biases not at all; then ``2·P``
    forward, ``2·P`` for the activation gradients and ``2·P`` for the weight gradients,
    so ``6·P`` for trainable weights and ``4·P`` for frozen ones (a LoRA base computes no weight gradients);
    the embedding lookup is not a matmul, the lm_head is (tied or not);
  * attention scores and values: ``4·L·s·q_dim`` forward, twice that backward: ``12·L·s·q_dim``;
  * activation checkpointing re-runs the forward: ``2·P + 4·L·s·q_dim`` more, counted in the hardware FLOPs
    (HFU), not in the model FLOPs (MFU).

``module_flop_counts(model)`` reads ``P`` (trainable and frozen) off a live module -- ``ds_numel`` under
DeepSpeed ZeRO-3, global sizes for DTensor shards -- and ``L``, ``q_dim`` off its config.

Not here: step time or efficiency (``throughput.py``), token counting (``hf_dist.trainer.throughput``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class FlopCounts:
    """What the FLOP formula needs from a model."""

    trainable_matmul: int
    """Elements of matmul weights that get gradients (LoRA: the adapters)."""
    frozen_matmul: int
    """Elements of matmul weights that do not (LoRA: the base)."""
    layers: int
    """Decoder layers (L)."""
    q_dim: int
    """Query heads x head dim."""

    def per_token(self, seq_len: int, *, recompute: bool = False) -> tuple[float, float]:
        """``(model FLOPs, hardware FLOPs)`` per token at sequence length ``seq_len``."""
        attention = 4 * self.layers * seq_len * self.q_dim
        model = 6 * self.trainable_matmul + 4 * self.frozen_matmul + 3 * attention
        hardware = model + (self.forward(seq_len) if recompute else 0)
        return float(model), float(hardware)

    def forward(self, seq_len: int) -> float:
        """FLOPs per token of one forward (no gradients): ``2·P`` over every matmul weight plus ``4·L·s·q_dim``
        (what recompute repeats, and what a frozen reference model runs)."""
        return float(2 * (self.trainable_matmul + self.frozen_matmul) + 4 * self.layers * seq_len * self.q_dim)


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 partitions leave numel() == 0


def module_flop_counts(model) -> FlopCounts:
    """``FlopCounts`` of a live HF causal LM (PEFT-wrapped, FSDP2/TP-sharded or ZeRO-3-partitioned)."""
    from torch import nn

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lm_head = output.weight if output is not None else None
    config = getattr(model, "config", None)
    active = _active_expert_fraction(config)
    trainable = frozen = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        ndim = len(getattr(p, "ds_shape", None) or p.shape)
        expert = ".experts." in f".{name}"
        if ndim < 2 or name.endswith("bias"):
            continue  # norms and biases (gpt-oss' expert biases are [E, out]): no matmul
        if id(p) in embeddings and p is not lm_head:
            continue  # a lookup (a tied weight counts once, as the lm_head matmul)
        n = _numel(p) * active if expert else _numel(p)  # taken before sharding: all E experts
        if p.requires_grad:
            trainable += int(n)
        else:
            frozen += int(n)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return FlopCounts(trainable_matmul=trainable, frozen_matmul=frozen, layers=layers, q_dim=heads * head_dim)


def _active_expert_fraction(config) -> float:
    """``k / E`` of a MoE config: the share of its routed experts one token runs through (1: no experts)."""
    from hf_dist.families import num_experts, text_config

    config = text_config(config)
    experts = num_experts(config)
    top_k = getattr(config, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0


__all__ = ["FlopCounts", "module_flop_counts"]

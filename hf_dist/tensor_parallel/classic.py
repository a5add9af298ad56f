"""Tensor-parallel plans, as data, for the classic dense model types transformers ships no plan for.

GPT-2, Falcon, OPT, BLOOM, ... predate ``base_model_tp_plan``. For each, ``CLASSIC_TP`` holds what the plan of
a newer model would say, written against the model's own module names (relative to its ``*ForCausalLM``),
plus the few facts about its attention that a plan alone cannot carry:

- ``plan``: ``{pattern: style_name}``, style names from ``plans.STYLE_BUILDERS``. Fused q/k/v projections
  whose rows are interleaved per head (BLOOM, Falcon, Persimmon ``query_key_value``) are plainly
  column-parallel: a contiguous slice of rows is whole heads, each with its q, k and v. GPT-2's ``c_attn`` is a
  ``Conv1D`` holding ``[q | k | v]``: it stays whole on every rank, each rank keeping its heads' columns
  (``conv1d_fused_qkv_slice``).
- ``local_attrs``: the attention module's head counts and split sizes that its forward reads and that must
  count this rank's heads only (``local_attrs`` style).
- ``heads`` / ``kv_heads`` / ``mlp_width``: the sizes the plan splits, read from the config (``checks.py``).
- ``refusal``: config values under which the plan would not be exact, as a reason (``support.py``).

Pure data and small functions of a config; imports nothing from hf_dist. Not for: applying (``apply.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


CLASSIC_STYLES: frozenset[str] = frozenset({
    "conv1d_colwise", "conv1d_rowwise", "conv1d_fused_qkv_slice", "local_attrs", "local_alibi",
    "rowwise_writable_output",
})
"""hf_dist's style names these plans use besides transformers' own (``plans.STYLE_BUILDERS``)."""


@dataclass(frozen=True, kw_only=True)
class ClassicPlan:
    """One model type's TP plan and the config facts it needs."""

    plan: dict[str, str]
    """``{module pattern: style name}``, relative to the ``*ForCausalLM``; ``lm_head`` kept only where exact."""
    local_attrs: tuple[str, ...] = ()
    """Integer attributes of the attention module divided by ``tp`` (head counts, split sizes)."""
    mlp_width: Callable = field(default=lambda c: c.intermediate_size)
    """``config -> int``: the MLP width the plan splits."""
    kv_heads: Callable = field(default=lambda c: c.num_attention_heads)
    """``config -> int``: key/value heads (the plan splits them with the query heads)."""
    refusal: Callable = field(default=lambda c: None)
    """``config -> str | None``: why the plan is not exact for this config."""


def _falcon_kv(config) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def _falcon_refusal(config) -> str | None:
    if config.alibi:
        return "alibi=True adds every head's ALiBi bias to one shared attention mask, which TP cannot split by head"
    return None


def _bloom_refusal(config) -> str | None:
    if config.pretraining_tp > 1 and config.slow_but_exact:
        return (f"slow_but_exact=True with pretraining_tp={config.pretraining_tp} slices the dense weights by "
                "column in the model's own forward; set slow_but_exact=False")
    return None


def _gpt2_refusal(config) -> str | None:
    if config.add_cross_attention:
        return "add_cross_attention=True (cross-attention layers have no plan)"
    return None


_GPT2 = "transformer.h.*"
_FALCON = "transformer.h.*"
_OPT = "model.decoder.layers.*"

CLASSIC_TP: dict[str, ClassicPlan] = {
    "gpt2": ClassicPlan(
        plan={
            f"{_GPT2}.attn.c_attn": "conv1d_fused_qkv_slice",
            f"{_GPT2}.attn.c_proj": "conv1d_rowwise",
            f"{_GPT2}.attn": "local_attrs",
            f"{_GPT2}.mlp.c_fc": "conv1d_colwise",
            f"{_GPT2}.mlp.c_proj": "conv1d_rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads", "split_size"),
        mlp_width=lambda c: c.n_inner or 4 * c.hidden_size,
        refusal=_gpt2_refusal,
    ),
    "falcon": ClassicPlan(
        plan={
            f"{_FALCON}.self_attention.query_key_value": "colwise",
            f"{_FALCON}.self_attention.dense": "rowwise",
            f"{_FALCON}.self_attention": "local_attrs",
            f"{_FALCON}.mlp.dense_h_to_4h": "colwise",
            f"{_FALCON}.mlp.dense_4h_to_h": "rowwise_writable_output",  # parallel attention adds to it in place
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads", "num_kv_heads"),
        mlp_width=lambda c: c.ffn_hidden_size,
        kv_heads=_falcon_kv,
        refusal=_falcon_refusal,
    ),
    "opt": ClassicPlan(
        plan={
            f"{_OPT}.self_attn.q_proj": "colwise",
            f"{_OPT}.self_attn.k_proj": "colwise",
            f"{_OPT}.self_attn.v_proj": "colwise",
            f"{_OPT}.self_attn.out_proj": "rowwise",
            f"{_OPT}.self_attn": "local_attrs",
            f"{_OPT}.fc1": "colwise",
            f"{_OPT}.fc2": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads",),
        mlp_width=lambda c: c.ffn_dim,
    ),
    "bloom": ClassicPlan(
        plan={
            f"{_FALCON}.self_attention.query_key_value": "colwise",
            f"{_FALCON}.self_attention.dense": "rowwise",
            f"{_FALCON}.self_attention": "local_attrs+local_alibi",
            f"{_FALCON}.mlp.dense_h_to_4h": "colwise",
            f"{_FALCON}.mlp.dense_4h_to_h": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads",),
        mlp_width=lambda c: 4 * c.hidden_size,
        refusal=_bloom_refusal,
    ),
}
"""Model type -> its plan as data (see module docstring)."""


def classic_plan(config) -> ClassicPlan | None:
    """The classic plan of ``config``'s model type, when transformers ships none of its own."""
    if getattr(config, "base_model_tp_plan", None):
        return None
    return CLASSIC_TP.get(getattr(config, "model_type", None))

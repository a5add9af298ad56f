"""Tensor-parallel plans, as data, for the classic dense model types transformers ships no plan for.

GPT-2, Falcon, OPT, BLOOM, GPT-J ... predate ``base_model_tp_plan``. For each, ``CLASSIC_TP`` holds what the plan of
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

Which types use these plans is their registry record's choice (``hf_dist.families``, ``Family.tp_plan``), not
whether transformers ships a plan: transformers 5.24 ships plans for gptj (hf_dist's, proven, stays) and codegen
(refused by name in the registry: its qkv is packed in blocks of ``mp_num=4``).
Pure data and small functions of a config; reads only the registry. Not for: applying (``apply.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


CLASSIC_STYLES: frozenset[str] = frozenset({
    "conv1d_colwise", "conv1d_rowwise", "conv1d_fused_qkv_slice", "local_attrs", "local_alibi",
    "rowwise_writable_output", "local_position_bias", "fused_colwise_qkv",
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
    only_if: dict[str, str] = field(default_factory=dict)
    """``{pattern: config flag}``: entries for modules the model builds only when the flag is set."""

    def plan_for(self, config) -> dict[str, str]:
        """The plan entries for the modules ``config``'s model has."""
        return {p: s for p, s in self.plan.items() if p not in self.only_if or getattr(config, self.only_if[p])}


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


def _stablelm_refusal(config) -> str | None:
    if config.qk_layernorm:
        return "qk_layernorm=True keeps one LayerNorm per head in a list that the forward zips with the local heads"
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
    "gpt_bigcode": ClassicPlan(
        plan={  # multi-head layout: c_attn rows are [q | k | v] per head, so a contiguous slice is whole heads
            f"{_GPT2}.attn.c_attn": "colwise",
            f"{_GPT2}.attn.c_proj": "rowwise",
            f"{_GPT2}.attn": "local_attrs",
            f"{_GPT2}.mlp.c_fc": "colwise",
            f"{_GPT2}.mlp.c_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads",),
        mlp_width=lambda c: c.n_inner or 4 * c.hidden_size,
        kv_heads=lambda c: 1 if c.multi_query else c.num_attention_heads,
        refusal=_gpt2_refusal,
    ),
    "gptj": ClassicPlan(
        plan={
            f"{_GPT2}.attn.q_proj": "colwise",
            f"{_GPT2}.attn.k_proj": "colwise",
            f"{_GPT2}.attn.v_proj": "colwise",
            f"{_GPT2}.attn.out_proj": "rowwise",
            f"{_GPT2}.attn": "local_attrs",
            f"{_GPT2}.mlp.fc_in": "colwise",
            f"{_GPT2}.mlp.fc_out": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_attention_heads",),
        mlp_width=lambda c: c.n_inner or 4 * c.hidden_size,
    ),
    "stablelm": ClassicPlan(
        plan={
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.self_attn": "local_attrs",
            "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads", "num_key_value_heads"),
        kv_heads=lambda c: c.num_key_value_heads,
        refusal=_stablelm_refusal,
    ),
    "persimmon": ClassicPlan(
        plan={  # query_key_value rows are [q, k, v] per head
            "model.layers.*.self_attn.query_key_value": "colwise",
            "model.layers.*.self_attn.dense": "rowwise",
            "model.layers.*.self_attn": "local_attrs",
            # one LayerNorm over head_dim shared by all heads: whole on every rank, gradient summed
            "model.layers.*.self_attn.q_layernorm": "replicated_with_grad_allreduce",
            "model.layers.*.self_attn.k_layernorm": "replicated_with_grad_allreduce",
            "model.layers.*.mlp.dense_h_to_4h": "colwise",
            "model.layers.*.mlp.dense_4h_to_h": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("num_heads",),
        only_if={f"model.layers.*.self_attn.{n}_layernorm": "qk_layernorm" for n in "qk"},
    ),
    "mpt": ClassicPlan(
        plan={  # Wqkv is [q | k | v]: each part split on its own
            "transformer.blocks.*.attn.Wqkv": "fused_colwise_qkv",
            "transformer.blocks.*.attn.out_proj": "rowwise",
            "transformer.blocks.*.attn": "local_attrs+local_position_bias",
            "transformer.blocks.*.ffn.up_proj": "colwise",
            "transformer.blocks.*.ffn.down_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
        local_attrs=("n_heads",),
        mlp_width=lambda c: 4 * c.hidden_size,
    ),
}
"""Model type -> its plan as data (see module docstring)."""


def classic_plan(config) -> ClassicPlan | None:
    """The classic plan of ``config``'s model type, where its registry record chooses hf_dist's plan
    (``Family.tp_plan``), whether or not the installed transformers ships one."""
    from hf_dist.families import family

    model_type = getattr(config, "model_type", None)
    if family(model_type).tp_plan != "hf_dist":
        return None
    return CLASSIC_TP.get(model_type)

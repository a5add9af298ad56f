"""Tensor-parallel plans as data, for the model types whose registry record carries one (``table.py`` names them).

Three kinds, each ``{module pattern: style name}`` (style names are built into DTensor styles by
``hf_dist.tensor_parallel.plans.STYLE_BUILDERS``):

- ``ClassicPlan``: a whole plan, relative to the ``*ForCausalLM``, for the classic dense types transformers ships no
  plan for (GPT-2, Falcon, OPT, BLOOM, GPT-J, ...), with the few facts about their attention a plan cannot carry.
  Fused q/k/v projections whose rows are interleaved per head (BLOOM, Falcon, Persimmon ``query_key_value``) are
  plainly column-parallel: a contiguous slice of rows is whole heads. GPT-2's ``c_attn`` is a ``Conv1D`` holding
  ``[q | k | v]``: it stays whole on every rank, each keeping its heads' columns (``conv1d_fused_qkv_slice``).
- ``GPT_OSS_BASE_TP``: a ``base_model_tp_plan`` (relative to the base model) for gpt-oss, whose attention sinks no
  plan of transformers splits (``hf_dist.tensor_parallel.moe``).
- hybrid overlays, laid over the model's own plan (the whole plan where it has none): Gated DeltaNet, LFM2 short
  convolutions, Mamba2 mixers (``hf_dist.tensor_parallel.hybrid`` describes how each is split).

Pure data and small functions of a config: no torch, no transformers. Not for: which types may use them (the
records' ``proven`` / ``refused``) or applying them (``hf_dist.tensor_parallel``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


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

GPT2_TP = ClassicPlan(
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
)

FALCON_TP = ClassicPlan(
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
)

OPT_TP = ClassicPlan(
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
)

BLOOM_TP = ClassicPlan(
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
)

GPT_BIGCODE_TP = ClassicPlan(
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
)

GPTJ_TP = ClassicPlan(
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
)

STABLELM_TP = ClassicPlan(
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
)

PERSIMMON_TP = ClassicPlan(
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
)

MPT_TP = ClassicPlan(
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
)



# hybrid overlays
_GDN = "model.layers.*.linear_attn"
_SHORT_CONV = "model.layers.*.conv"
_MAMBA = "model.layers.*.mamba"

GATED_DELTANET_TP: dict[str, str] = {
    f"{_GDN}.in_proj_qkv": "gdn_fused_qkv",
    f"{_GDN}.in_proj_z": "colwise",
    f"{_GDN}.in_proj_b": "colwise",
    f"{_GDN}.in_proj_a": "colwise",
    f"{_GDN}.out_proj": "rowwise",
    _GDN: "gdn_local_params",
    f"{_GDN}.norm": "whole_local_weight",
}
"""Qwen3.5's Gated DeltaNet layers (attention and MLP: the model's own plan)."""

SHORT_CONV_TP: dict[str, str] = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.out_proj": "rowwise",
    "model.layers.*.self_attn.q_layernorm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_layernorm": "replicated_with_grad_allreduce",
    "model.layers.*.feed_forward.w1": "colwise",
    "model.layers.*.feed_forward.w3": "colwise",
    "model.layers.*.feed_forward.w2": "rowwise",
    f"{_SHORT_CONV}.in_proj": "short_conv_fused_bcx",
    f"{_SHORT_CONV}.out_proj": "rowwise",
    _SHORT_CONV: "short_conv_local_params",
    "lm_head": "colwise_gather_output",
}
"""LFM2: short convolutions, attention and MLP (transformers ships no plan for it)."""

MAMBA2_TP: dict[str, str] = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.feed_forward.gate_proj": "colwise",
    "model.layers.*.feed_forward.up_proj": "colwise",
    "model.layers.*.feed_forward.down_proj": "rowwise",
    f"{_MAMBA}.in_proj": "mamba2_fused_in_proj",
    f"{_MAMBA}.out_proj": "rowwise",
    _MAMBA: "mamba2_local_params",
    "lm_head": "colwise_gather_output",
}
"""Mamba2 + attention hybrids (Bamba: one kind per layer), split by head groups."""

MAMBA2_MUP_TP: dict[str, str] = {**MAMBA2_TP, _MAMBA: "mamba2_mup_local_params"}
"""Falcon-H1 (Mamba2 and attention in every layer): as ``MAMBA2_TP``, its mixer also holding a muP vector sliced like
``in_proj``, an optional grouped norm that counts its groups, and ``groups_time_state_size``."""

GPT_OSS_BASE_TP: dict[str, str] = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn": "local_sinks",
    "layers.*.mlp.experts": "moe_tp_experts",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
}
"""gpt-oss's ``base_model_tp_plan``: attention split by head with its sinks (``local_sinks``), the routed experts
split along their intermediate dimension."""


@dataclass(frozen=True)
class HeadNorm:
    """A norm over one head's features that the model's plan leaves out, present when ``flag`` is set."""

    flag: str
    """The config field that switches the norm on."""
    patterns: tuple[str, ...]
    """The norm modules."""
    style: str
    """``replicated_with_grad_allreduce``: one weight shared by all heads, whole on every rank with its gradient
    (partial per rank) reduced; ``head_sharded_norm``: one weight row per head, split by head."""


SHARED_QK_LAYERNORM = HeadNorm("qk_layernorm", ("model.layers.*.self_attn.q_layernorm",
                                                "model.layers.*.self_attn.k_layernorm"),
                               "replicated_with_grad_allreduce")
PER_HEAD_QK_NORM = HeadNorm("use_qk_norm", ("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"),
                            "head_sharded_norm")

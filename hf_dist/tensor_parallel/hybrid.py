"""Tensor-parallel overlays, as data, for the non-attention layers of hybrid models.

transformers' plans for Qwen3.5 gather the Gated DeltaNet projections on every rank (each rank then runs the
whole recurrent layer), and LFM2 ships no plan at all. ``HYBRID_TP`` writes, per model type, the entries that
shard these layers by head or by channel, on top of (and replacing entries of) the model's own plan:

- Gated DeltaNet (``qwen3_5_text``): ``in_proj_qkv`` split part by part (``[q | k | v]``, each by head),
  ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` column-parallel (value heads), the depthwise short convolution
  split by channel in the same part order, ``A_log`` / ``dt_bias`` by value head, ``out_proj`` row-parallel; the
  gated norm's weight (one row shared by the heads) stays whole with its gradient summed over the ranks. Key and
  value heads split in contiguous ranges, so each value head keeps the key head it is grouped with.
- LFM2 short convolutions (``lfm2``): ``in_proj`` split part by part (``[B | C | x]``, by channel), the depthwise
  conv by channel, ``out_proj`` row-parallel; its attention and MLP as any GQA model's.
- Mamba2 mixers (``falcon_h1``, ``bamba``): by head groups (``tp`` divides ``mamba_n_groups``): ``in_proj`` split
  part by part (``[gate | x | B | C | dt]``), the conv over ``[x | B | C]`` likewise, ``A_log`` / ``D`` /
  ``dt_bias`` by head, the grouped gated norm by channel, Falcon-H1's ``mup_vector`` sliced like ``in_proj``,
  ``out_proj`` row-parallel; attention and MLP as any GQA model's. Only the unfused (PyTorch) Mamba2 path is
  sharded: with ``mamba_ssm`` kernels installed the fused training path reads ``out_proj.weight`` itself.

The registry (``hf_dist.families``) names the hybrid types whose layers have no exact overlay yet, with the reason.
Pure data and small functions of a config. Not for: applying (``apply.py``) or the support decision.
"""

from __future__ import annotations

import importlib.util

from hf_dist.tensor_parallel.hybrid_styles import LocalParams
from hf_dist.tensor_parallel.styles import FusedColwiseParallel

_GDN = "model.layers.*.linear_attn"
_SHORT_CONV = "model.layers.*.conv"
_MAMBA = "model.layers.*.mamba"

# Mamba2 + attention hybrids (Falcon-H1 runs both in every layer, Bamba one per layer): split by head groups.
_MAMBA2_HYBRID = {
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

HYBRID_TP: dict[str, dict[str, str]] = {
    "qwen3_5_text": {
        f"{_GDN}.in_proj_qkv": "gdn_fused_qkv",
        f"{_GDN}.in_proj_z": "colwise",
        f"{_GDN}.in_proj_b": "colwise",
        f"{_GDN}.in_proj_a": "colwise",
        f"{_GDN}.out_proj": "rowwise",
        _GDN: "gdn_local_params",
        f"{_GDN}.norm": "whole_local_weight",
    },
    "lfm2": {
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
    },
    "falcon_h1": _MAMBA2_HYBRID,
    "bamba": _MAMBA2_HYBRID,
}
"""Model type -> ``{pattern: style name}`` laid over the model's own plan (the whole plan where it has none)."""

def _gdn_parts(config) -> tuple[int, int, int]:
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return key, key, config.linear_num_value_heads * config.linear_value_head_dim


def _mamba2_parts(config) -> tuple[int, ...]:
    """Row counts of a Mamba2 ``in_proj``: ``[gate | x | B | C | dt]`` (the conv runs over ``[x | B | C]``)."""
    inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
    state = config.mamba_n_groups * config.mamba_d_state
    return inner, inner, state, state, config.mamba_n_heads


def _mamba2_local_params(config) -> LocalParams:
    parts = _mamba2_parts(config)
    falcon = config.model_type == "falcon_h1"
    norm = config.mamba_rms_norm if falcon else True  # the grouped gated norm: weight by channel
    return LocalParams(
        shards={"conv1d.weight": parts[1:4], "conv1d.bias": parts[1:4], "dt_bias": (), "A_log": (), "D": (),
                **({"norm.weight": ()} if norm else {})},
        # Falcon-H1's norm counts its groups (per rank: n_groups / tp), Bamba's keeps a fixed group size
        attrs=("num_heads", "intermediate_size", "conv_dim", "n_groups",
               *(("groups_time_state_size",) if falcon else ()), *(("norm.n_groups",) if falcon and norm else ())),
        buffers={"mup_vector": parts} if falcon else {},
    )


def _lfm2_mlp_width(config) -> int:
    """The width ``Lfm2MLP`` builds (it adjusts ``intermediate_size`` when ``block_auto_adjust_ff_dim``)."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    return width


HYBRID_STYLE_BUILDERS = {
    "gdn_fused_qkv": lambda config: FusedColwiseParallel(_gdn_parts(config)),
    "gdn_local_params": lambda config: LocalParams(
        shards={"conv1d.weight": _gdn_parts(config), "conv1d.bias": _gdn_parts(config), "A_log": (), "dt_bias": ()},
        attrs=("key_dim", "value_dim", "conv_dim", "num_k_heads", "num_v_heads"),
    ),
    "whole_local_weight": lambda config: LocalParams(whole=("weight",)),
    "short_conv_fused_bcx": lambda config: FusedColwiseParallel((config.hidden_size,) * 3),
    "short_conv_local_params": lambda config: LocalParams(shards={"conv.weight": (), "conv.bias": ()}),
    "mamba2_fused_in_proj": lambda config: FusedColwiseParallel(_mamba2_parts(config)),
    "mamba2_local_params": _mamba2_local_params,
}
"""Style name -> ``config -> ParallelStyle`` for the names ``HYBRID_TP`` uses (merged into ``STYLE_BUILDERS``)."""
HYBRID_STYLES: frozenset[str] = frozenset(HYBRID_STYLE_BUILDERS)


def hybrid_tp_refusal(config) -> str | None:
    """Why the overlay of ``config``'s type is not exact here, or ``None``: the fused Mamba2 training kernel of
    ``mamba_ssm``, which reads ``out_proj.weight`` itself past the row split. (The registry's named refusals are
    read first, by ``support.tp_refusal``.)"""
    model_type = getattr(config, "model_type", None)
    if HYBRID_TP.get(model_type) is _MAMBA2_HYBRID and importlib.util.find_spec("mamba_ssm") is not None:
        return ("mamba_ssm is installed: its fused Mamba2 training kernel applies out_proj.weight whole, past "
                "the TP split")
    return None


def layer_kind_patterns(config, names: dict[str, str]) -> frozenset[str]:
    """The plan patterns under the decoder layers of a hybrid type: a pipeline stage may own no layer of one
    kind (no Gated DeltaNet, no attention), so these may match nothing there. On the whole model every one
    matches (``tests/test_hybrid.py``)."""
    if getattr(config, "model_type", None) not in HYBRID_TP:
        return frozenset()
    return frozenset(p for p in names if p.startswith("model.layers.*."))


def hybrid_overlay(config) -> dict[str, str]:
    """The overlay of ``config``'s model type (empty for other types)."""
    return dict(HYBRID_TP.get(getattr(config, "model_type", None), {}))


def hybrid_sizes(config) -> dict[str, int]:
    """The sizes the overlay splits, ``{name: value}``, that the model's own plan does not already name."""
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen3_5_text":
        return {"linear_num_key_heads": config.linear_num_key_heads,
                "linear_num_value_heads": config.linear_num_value_heads}
    if model_type == "lfm2":
        return {"hidden_size (short-conv channels)": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "feed-forward width (from intermediate_size)": _lfm2_mlp_width(config)}
    if model_type in ("falcon_h1", "bamba"):
        return {"mamba_n_groups": config.mamba_n_groups, "mamba_n_heads": config.mamba_n_heads,
                "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    return {}

"""Tensor-parallel overlays, as data, for the non-attention layers of hybrid models.

transformers' plans for Qwen3.5 gather the Gated DeltaNet projections on every rank (each rank then runs the
whole recurrent layer), and LFM2 ships no plan at all. The registry records of these types (``hf_dist.families``,
``Family.tp_overlay``; the data is in ``families/tp_plans.py``) carry the entries that shard these layers by head or
by channel, on top of (and replacing entries of) the model's own plan; this module builds their styles:

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

The registry also names the hybrid types whose layers have no exact overlay yet, with the reason.
Small functions of a config. Not for: applying (``apply.py``) or the support decision.
"""

from __future__ import annotations

import importlib.util

from hf_dist.families import family_of
from hf_dist.tensor_parallel.hybrid_styles import LocalParams
from hf_dist.tensor_parallel.styles import FusedColwiseParallel


def _gdn_parts(config) -> tuple[int, int, int]:
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return key, key, config.linear_num_value_heads * config.linear_value_head_dim


def _mamba2_parts(config) -> tuple[int, ...]:
    """Row counts of a Mamba2 ``in_proj``: ``[gate | x | B | C | dt]`` (the conv runs over ``[x | B | C]``)."""
    inner = getattr(config, "mamba_d_ssm", None) or int(config.mamba_expand * config.hidden_size)
    state = config.mamba_n_groups * config.mamba_d_state
    return inner, inner, state, state, config.mamba_n_heads


def _mamba2_local_params(config, *, mup: bool = False) -> LocalParams:
    """Bamba's mixer; with ``mup``, Falcon-H1's (its optional grouped norm counts its groups, per rank n_groups / tp,
    where Bamba's keeps a fixed group size; a muP vector sliced like ``in_proj``; ``groups_time_state_size``)."""
    parts = _mamba2_parts(config)
    norm = config.mamba_rms_norm if mup else True  # the grouped gated norm: weight by channel
    return LocalParams(
        shards={"conv1d.weight": parts[1:4], "conv1d.bias": parts[1:4], "dt_bias": (), "A_log": (), "D": (),
                **({"norm.weight": ()} if norm else {})},
        attrs=("num_heads", "intermediate_size", "conv_dim", "n_groups",
               *(("groups_time_state_size",) if mup else ()), *(("norm.n_groups",) if mup and norm else ())),
        buffers={"mup_vector": parts} if mup else {},
    )


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
    "mamba2_mup_local_params": lambda config: _mamba2_local_params(config, mup=True),
}
"""Style name -> ``config -> ParallelStyle`` for the names the overlays use (merged into ``STYLE_BUILDERS``)."""
HYBRID_STYLES: frozenset[str] = frozenset(HYBRID_STYLE_BUILDERS)


def hybrid_tp_refusal(config) -> str | None:
    """Why the overlay of ``config``'s type is not exact here, or ``None``: the fused Mamba2 training kernel of
    ``mamba_ssm``, which reads ``out_proj.weight`` itself past the row split. (The registry's named refusals are
    read first, by ``support.tp_refusal``.)"""
    if "mamba2_fused_in_proj" in hybrid_overlay(config).values() and importlib.util.find_spec("mamba_ssm") is not None:
        return ("mamba_ssm is installed: its fused Mamba2 training kernel applies out_proj.weight whole, past "
                "the TP split")
    return None


def layer_kind_patterns(config, names: dict[str, str]) -> frozenset[str]:
    """The plan patterns under the decoder layers of a hybrid type: a pipeline stage may own no layer of one
    kind (no Gated DeltaNet, no attention), so these may match nothing there. On the whole model every one
    matches (``tests/test_hybrid.py``)."""
    if not hybrid_overlay(config):
        return frozenset()
    return frozenset(p for p in names if p.startswith("model.layers.*."))


def hybrid_overlay(config) -> dict[str, str]:
    """The overlay of ``config``'s model type (its registry record's ``tp_overlay``; empty for other types)."""
    return dict(family_of(config).tp_overlay or {})


def hybrid_sizes(config) -> dict[str, int]:
    """The sizes the overlay splits, ``{name: value}``, that the model's own plan does not already name (its
    registry record's ``tp_overlay_sizes``)."""
    return {label: getattr(config, read) if isinstance(read, str) else read(config)
            for label, read in family_of(config).tp_overlay_sizes.items()}

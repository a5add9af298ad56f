"""The config fields hf_dist reads from many model types, read in one place (pure: a config in, numbers out).

Model types name the same quantity differently (routed experts: ``num_experts``, ``num_local_experts``,
``n_routed_experts``, ...); every reader asks these functions instead of keeping its own list.
"""

from __future__ import annotations

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")


def text_config(config):
    """The decoder's config of a multimodal wrapper (where the layers are); the config itself otherwise."""
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):  # no text part, or several (encoder-decoder): the config itself
        return config


def expert_count_field(config) -> str | None:
    """``"name=value"`` of the field giving the routed experts per MoE layer; None for a dense config (also an
    expert count switched off by ``is_moe=False``, doge)."""
    config = text_config(config)
    if getattr(config, "is_moe", None) is False:
        return None
    for name in EXPERT_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return f"{name}={value}"
    return None


def num_experts(config) -> int | None:
    """Routed experts per MoE layer, from whichever field the model type uses; None for a dense config."""
    field = expert_count_field(config)
    return None if field is None else int(field.split("=")[1])


def attention_heads(config) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)``; key/value heads default to the query heads."""
    config = text_config(config)
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def auto_adjusted_ff_width(config) -> int:
    """The feed-forward width an MLP with ``block_auto_adjust_ff_dim`` builds from ``intermediate_size`` (LFM2:
    two thirds, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``)."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    return width

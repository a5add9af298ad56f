"""A tiny twin of a model config: same class, every behaviour field kept, only the sizes shrunk.

The pipeline canary (``hf_dist.pipeline_parallel.canary``) and the coverage sweep in the tests build one to
check, in a second or so, that a layout reproduces the unsplit model *of this architecture with these
settings*: soft-capping, multipliers, logit scale, norms, biases, tied embeddings, rotary settings and the
per-layer attention types stay as the user set them. Sizes that only scale the compute shrink (hidden size,
heads, layers, vocabulary, MLA ranks), and a sliding window is cut to ``window`` tokens so that it actually
windows the twin's short sequences (a window at least as long as the sequence would hide a missing window).
Dropout probabilities are set to 0: two runs with dropout differ by their random masks, not by their layout.

Pure: a config in, a new config out. Not for: building or running models.
"""

from __future__ import annotations

import dataclasses

HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 32, 4, 8, 64, 128

# Size fields and their twin values, set only where the config has them.
_SIZES = {
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "ffn_hidden_size": INTERMEDIATE,  # falcon
    "ffn_dim": INTERMEDIATE,  # opt
    "num_attention_heads": HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    # multi-head latent attention (deepseek-style) ranks
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": HEAD_DIM,
    "qk_nope_head_dim": HEAD_DIM,
    "v_head_dim": HEAD_DIM,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")

# Hybrid layers (Gated DeltaNet, Mamba2): head counts (times ``width``), head and state sizes, and a chunk size
# shorter than the twin's sequences, so that the chunked scans cross chunk boundaries as the real model does.
_HYBRID_SIZES = {"linear_key_head_dim": 8, "linear_value_head_dim": 8, "mamba_d_head": 16, "mamba_d_state": 8,
                 "mamba_chunk_size": 8}
_HYBRID_HEADS = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "mamba_n_heads": 4}


def _twin_layer_types(layer_types: list[str], layers: int) -> list[str]:
    """``layers`` types: the original's pattern repeated (cut, or tiled when the twin has more layers than the
    original, whose config must list one type per layer), with every kind of the original kept (the last slots
    take missing kinds)."""
    kinds = list(dict.fromkeys(layer_types))
    types = [layer_types[i % len(layer_types)] for i in range(layers)]
    missing = [k for k in kinds if k not in types]
    for i, kind in enumerate(missing):
        types[layers - 1 - i] = kind
    return types


def _kv_heads(config, width: int) -> int | None:
    kv = getattr(config, "num_key_value_heads", None)
    if kv is None:
        return None
    if getattr(config, "kv_lora_rank", None) is not None:
        # Multi-head latent attention: keys and values come out of kv_b_proj with one head per query head, and
        # num_key_value_heads only sets how sdpa repeats them (DeepSeek-V3's default 128 gives 128 // heads = 0
        # repeats on a small model). A "grouped" twin would repeat 4 key heads to 8 against 4 query heads.
        return HEADS * width
    heads = getattr(config, "num_attention_heads", None)
    return HEADS * width if kv == heads else HEADS * width // 2  # multi-head stays so, grouped stays grouped


def _mla_derived(values: dict, config) -> None:
    """Multi-head latent attention: the head sizes the config class derives from the twin's ranks in
    ``__post_init__`` (``qk_head_dim = qk_nope + qk_rope``; ``head_dim``, the rotary width, per class) are dropped
    so that it derives them again; ``to_dict()`` carried the original's, which would override the twin's."""
    if values.get("kv_lora_rank") is None:
        return
    fields = {f.name for f in dataclasses.fields(type(config))} if dataclasses.is_dataclass(type(config)) else set()
    for name in ("qk_head_dim", "head_dim"):
        if name in values and name not in fields:
            values.pop(name)
    if values.get("qk_head_dim") is not None:  # a field (LongCat-Flash): set to the twin's sum
        values["qk_head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]


def _token_id(value, vocab: int):
    if isinstance(value, int) and value >= vocab:
        return 0
    if isinstance(value, list):
        return [v if v < vocab else 0 for v in value]
    return value


def _shrink_hybrid(values: dict, width: int, layers: int) -> None:
    """Twin sizes for linear-attention / Mamba2 fields, and attention layers kept among the first ``layers``."""
    for name, size in _HYBRID_SIZES.items():
        if isinstance(values.get(name), int) or (name == "mamba_d_head" and values.get(name) == "auto"):
            values[name] = size
    for name, heads in _HYBRID_HEADS.items():
        if isinstance(values.get(name), int):
            values[name] = heads * width
    if isinstance(values.get("mamba_n_groups"), int):  # grouped stays grouped; must divide the heads
        values["mamba_n_groups"] = (2 if values["mamba_n_groups"] > 1 else 1) * width
    if isinstance(values.get("mamba_d_ssm"), int) and isinstance(values.get("mamba_n_heads"), int):
        values["mamba_d_ssm"] = values["mamba_n_heads"] * values["mamba_d_head"]
    if values.get("mamba_expand") and isinstance(values.get("mamba_n_heads"), int) and "mamba_d_ssm" not in values:
        values["mamba_d_head"] = values["mamba_expand"] * HIDDEN * width // values["mamba_n_heads"]
    indices = values.get("attn_layer_indices")  # Bamba: attention layers by index
    if indices:
        values["attn_layer_indices"] = [i for i in indices if i < layers] or [layers - 1]


def tiny_twin(config, *, layers: int = 4, window: int = 8, width: int = 1):
    """A copy of ``config`` with twin sizes, ``layers`` decoder layers and sliding windows of ``window``.

    ``width`` multiplies hidden size, heads and MLP width (e.g. the tensor-parallel degree, which must divide
    the heads).
    """
    values = config.to_dict()
    widened = {"hidden_size", "intermediate_size", "ffn_hidden_size", "ffn_dim", "num_attention_heads"}
    aliases = getattr(config, "attribute_map", {}) or {}  # GPT-2 style names: hidden_size -> n_embd, ...
    for name, size in _SIZES.items():
        key = aliases.get(name, name)
        if key in values and values[key] is not None:
            values[key] = size * width if name in widened else size
    kv = _kv_heads(config, width)
    if kv is not None:
        values["num_key_value_heads"] = kv
    if isinstance(values.get("num_kv_heads"), int):  # falcon's name: multi-head stays so, grouped stays grouped
        same = values["num_kv_heads"] == getattr(config, "num_attention_heads", None)
        values["num_kv_heads"] = HEADS * width if same else HEADS * width // 2
    _mla_derived(values, config)
    _shrink_hybrid(values, width, layers)
    values[aliases.get("num_hidden_layers", "num_hidden_layers")] = layers
    if values.get("layer_types"):
        values["layer_types"] = _twin_layer_types(values["layer_types"], layers)
    if isinstance(values.get("sliding_window"), int):
        values["sliding_window"] = min(values["sliding_window"], window)
    if isinstance(values.get("max_window_layers"), int):
        values["max_window_layers"] = min(values["max_window_layers"], layers // 2)
    for name, value in values.items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            values[name] = 0.0  # random: a twin run with dropout cannot be compared with another run
    for name in _TOKEN_IDS:
        if name in values:
            values[name] = _token_id(values[name], VOCAB)
    for name in ("_name_or_path", "architectures", "transformers_version", "model_type"):
        values.pop(name, None)
    return type(config)(**values)

"""Tiny configs, with non-default values, for every dense causal-LM model type with a tensor-parallel plan.

``sweep_config(model_type)`` builds the config class of ``model_type`` with tiny sizes (hidden 64, 4 heads,
2 KV heads, head_dim 8 so that heads x head_dim != hidden, 2 layers, vocab 256) and, wherever the config
has the field, a value other than its default for every knob read outside the decoder layers or inside
attention (biases, rotary, scaling, soft-capping, multipliers, windows, qk-norms, tied embeddings). Dropout
is zero everywhere (the comparison is exact). Read through ``parity.tiny_config`` by the TP parity tests
(``test_tp_sweep.py``, ``test_tp_parity.py``, ``test_tp_lora.py``, ``test_tp_trainer.py``, ``test_parallelize.py``)
and by ``bench/coverage.py``.
"""

from __future__ import annotations

SEQ = 16
SIZES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)
NON_DEFAULT = {
    "attention_bias": True,
    "mlp_bias": True,
    "use_bias": True,
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5,
    "logit_scale": 0.5,
    "final_logit_softcapping": 5.0,
    "attn_logit_softcapping": 20.0,
    "query_pre_attn_scalar": 12,
    "embedding_multiplier": 12.0,
    "logits_scaling": 8.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078,
    "sliding_window": 8,
    "use_qk_norm": True,
    "qk_layernorm": True,
    "clip_qkv": 0.5,
    "hidden_act": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-5,
}
"""Field -> a value other than the usual default, applied where the config has the field."""
PER_TYPE: dict[str, dict] = {
    "helium": {"head_dim": 16},  # its o_proj is hidden x hidden: heads x head_dim must equal hidden
    "youtu": {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
              "qk_nope_head_dim": 8, "v_head_dim": 8},  # latent attention (kept whole by its plan) made tiny
    "gemma3n_text": {"num_kv_shared_layers": 0, "laurel_rank": 8, "hidden_size_per_layer_input": 8,
                     "altup_num_inputs": 2, "activation_sparsity_pattern": [0.0, 0.0]},
    "hyperclovax": {"logits_scaling": 0.125},  # a multiplier here (MuP): 8 would scale fp32 rounding past 1e-5
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5000.0}}},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "max_window_layers": 1},
    "gpt_neox": {"use_parallel_residual": False},
    # OLMo-2/3 normalise the attention output: at the default init (0.02) o_proj's tiny output makes the first step's
    # o_proj.bias gradient ~45, where fp32 rounding alone (one process against fp64: 1.5e-5 to 2.6e-5) exceeds 1e-5;
    # at 0.1 the largest gradient is 1.6 and that rounding 1.5e-6
    # its image and audio encoders (unused by text, but built, saved and compared) at their default sizes: 870M weights
    "phi4_multimodal": {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                          "num_attention_heads": 2},
                        "audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1,
                                         "num_attention_heads": 2, "ext_pw_out_channel": 32,
                                         "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32}},
    "olmo2": {"initializer_range": 0.1},
    "olmo3": {"initializer_range": 0.1},
    # classic types (hf_dist's own plans, hf_dist/tensor_parallel/classic.py)
    "gpt2": {"n_inner": 96, "reorder_and_upcast_attn": True, "scale_attn_by_inverse_layer_idx": True,
             "activation_function": "relu", "layer_norm_epsilon": 1e-4},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True, "ffn_hidden_size": 96},
    "opt": {"word_embed_proj_dim": 32, "ffn_dim": 96, "do_layer_norm_before": False, "enable_bias": False,
            "activation_function": "gelu"},
    # 6 heads: ALiBi slopes of a head count that is not a power of two (the extra-slopes branch)
    "bloom": {"hidden_size": 96, "num_attention_heads": 6, "apply_residual_connection_post_layernorm": True},
    "gpt_bigcode": {"multi_query": False, "n_inner": 96, "scale_attn_weights": False,
                    "attention_softmax_in_fp32": False},
    "gptj": {"rotary_dim": 4, "n_inner": 96},
    "stablelm": {"use_qkv_bias": True, "use_parallel_residual": True, "qk_layernorm": False},
    "persimmon": {"qk_layernorm": True, "partial_rotary_factor": 0.25},
    # 6 heads: MPT's ALiBi slopes for a head count that is not a power of two; clipped q/k/v
    "mpt": {"hidden_size": 96, "num_attention_heads": 6, "attn_config": {"clip_qkv": 0.5, "alibi_bias_max": 4}},
}
VARIANTS: dict[str, tuple[str, dict]] = {
    "falcon:mha": ("falcon", {"multi_query": False, "parallel_attn": False, "bias": True, "ffn_hidden_size": 96}),
    "falcon:mqa": ("falcon", {"multi_query": True}),
    "falcon:alibi": ("falcon", {"multi_query": False, "alibi": True}),
    "bloom:slow_but_exact": ("bloom", {"pretraining_tp": 2, "slow_but_exact": True}),
    "gpt_bigcode:mqa": ("gpt_bigcode", {"multi_query": True}),
    "stablelm:qk_layernorm": ("stablelm", {"qk_layernorm": True}),
    "persimmon:no_qk_layernorm": ("persimmon", {"qk_layernorm": False}),
    "codegen": ("codegen", {}),
    # what the generic values leave out (every type above ties its head where its default does not): an untied head
    # (split by columns, or by vocab), and one KV head for all query heads (each TP rank keeps a copy of it)
    "llama:untied": ("llama", {"tie_word_embeddings": False}),
    "llama:mqa": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": False}),
    "qwen2:mqa": ("qwen2", {"num_key_value_heads": 1, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3:mqa": ("qwen3", {"num_key_value_heads": 1, "use_sliding_window": True, "max_window_layers": 1,
                            "tie_word_embeddings": False}),
}
"""Named cases ``type:variant``: other layouts of one model type, supported (in ``TP_VARIANTS`` or
``TP_LAYOUT_VARIANTS``) or refused."""
TP_VARIANTS = ("falcon:mha", "persimmon:no_qk_layernorm")
"""Variants that TP must run equal to one process in the sweep."""
TP_LAYOUT_VARIANTS = ("llama:untied", "llama:mqa", "qwen2:mqa", "qwen3:mqa")
"""Variants ``tests/test_tp_parity.py`` runs under sequence, vocab and data parallelism beside TP. Every other
variant must be refused before launch."""


def _has(config, field: str) -> bool:
    try:
        return hasattr(config, field)
    except Exception:  # per-layer attributes of heterogeneous configs raise their own error type
        return False


def _rope(config_cls) -> dict:
    """A non-default rotary base, in whichever form the config takes it."""
    params = getattr(config_cls(), "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return {"rope_parameters": {**params, "rope_theta": 5000.0}}
    return {}


HYBRID_CASES = {"qwen3_5_text": "qwen3_5_text:deltanet", "lfm2": "lfm2:conv", "falcon_h1": "falcon_h1:mamba2",
                "bamba": "bamba:mamba2"}
"""Hybrid types: the written-out configs of the PP sweep (``pp_sweep_cases.HYBRID``: layer pattern, conv
kernel, key/value heads non-default), since the generic sizes here do not shrink their own layers."""


def sweep_config(model_type: str):
    """A tiny config of ``model_type`` (or a ``VARIANTS`` case) with non-default values (module docstring)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in HYBRID_CASES:
        from pp_sweep_cases import hybrid_config

        config = hybrid_config(HYBRID_CASES[model_type])
        config._attn_implementation = "eager"
        return config

    model_type, variant = VARIANTS.get(model_type, (model_type, {}))
    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls()
    kwargs = {k: v for k, v in SIZES.items() if _has(defaults, k) and not isinstance(getattr(config_cls, k, None), property)}
    for field, value in NON_DEFAULT.items():
        settable = not isinstance(getattr(config_cls, field, None), property)
        if settable and _has(defaults, field) and getattr(defaults, field) != value:
            kwargs[field] = value
    pad = getattr(defaults, "pad_token_id", None)
    if isinstance(pad, int) and pad >= SIZES["vocab_size"]:
        kwargs["pad_token_id"] = 0
    kwargs["tie_word_embeddings"] = not getattr(defaults, "tie_word_embeddings", False)
    kwargs.update(_rope(config_cls))
    kwargs.update(PER_TYPE.get(model_type, {}) if not variant else variant)
    for field in defaults.to_dict():
        if "dropout" in field or field.endswith("pdrop"):
            kwargs[field] = 0.0
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    return config


def dense_plan_types() -> list[str]:
    """Causal-LM model types of the installed transformers whose config ships a ``base_model_tp_plan``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(t for t in types if getattr(CONFIG_MAPPING[t], "base_model_tp_plan", None))

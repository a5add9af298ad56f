"""The PP coverage sweep's cases: one tiny config per dense causal-LM model type, with NON-default values.

Every field the modeling code reads outside the decoder layers (logit scale and soft-capping, embedding and
logit multipliers, sliding windows shorter than the sequence, tied embeddings flipped from the default) is
set away from its default wherever the model type's config has it, then shrunk with ``tiny_twin``.
Imported by ``test_pp_sweep.py`` and by its spawned ranks.
"""

from __future__ import annotations

SEQ = 32

# Applied where the config class has the field; each differs from every default in transformers 5.23.
NON_DEFAULT = {
    "sliding_window": 8,
    "use_sliding_window": True,
    "max_window_layers": 1,
    "final_logit_softcapping": 5.0,
    "attn_logit_softcapping": 20.0,
    "logit_scale": 0.5,
    "logits_scaling": 8.0,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078,
    "query_pre_attn_scalar": 12,
    "output_multiplier": 0.3,
    "embedding_scale": 2.5,
    "scale_emb": 3.0,
    "scale_depth": 1.7,
    "dim_model_base": 16,
}

# Fields a model type's default config leaves unset although its model needs them (ministral: head_dim=None).
NEEDED = {"ministral": {"head_dim": 128}}

# The classic types (hf_dist's own pp plans, hf_dist/pipeline_parallel/plans.py): their own knobs moved.
PER_TYPE = {
    "gpt2": {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True,
             "activation_function": "relu", "n_inner": 48},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 8, "bias": True},
    "opt": {"word_embed_proj_dim": 16, "do_layer_norm_before": False, "enable_bias": False},
    "bloom": {"apply_residual_connection_post_layernorm": True},
    "nemotron": {"partial_rotary_factor": 0.25, "num_key_value_heads": 8},  # its default None fails to build
    "gpt_bigcode": {"multi_query": False, "scale_attn_weights": False, "n_inner": 48},
    "gptj": {"rotary_dim": 4, "n_inner": 48},
    "codegen": {"rotary_dim": 4, "n_inner": 48},
    "stablelm": {"qk_layernorm": True, "use_parallel_residual": True, "use_qkv_bias": True},
    "persimmon": {"qk_layernorm": False},
    "mpt": {"attn_config": {"clip_qkv": 0.5, "alibi_bias_max": 4}},
}

# The named cases, as the user would write them (defaults where the issue says "default").
NAMED = {
    "cohere:default": ("cohere", {}),
    "cohere2:default": ("cohere2", {}),
    "gemma2:default": ("gemma2", {}),
    "gemma2:softcap5": ("gemma2", {"final_logit_softcapping": 5.0}),
    "granite:multipliers": ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0,
                                        "residual_multiplier": 0.22, "attention_multiplier": 0.0078}),
    "mistral:window8": ("mistral", {"sliding_window": 8}),
    "phi3:window8": ("phi3", {"sliding_window": 8}),
    "starcoder2:window8": ("starcoder2", {"sliding_window": 8}),
    "falcon:mqa": ("falcon", {"multi_query": True, "parallel_attn": False}),
    "falcon:alibi": ("falcon", {"multi_query": False, "alibi": True}),
    "gpt_bigcode:mqa": ("gpt_bigcode", {"multi_query": True}),
}


def non_default_config(model_type: str, **extra):
    """The model type's default config with ``NON_DEFAULT`` applied where it has the field, made tiny."""
    from transformers import AutoConfig

    from hf_dist.models.twin import tiny_twin

    default = AutoConfig.for_model(model_type)
    derived = {k for k in NON_DEFAULT if isinstance(getattr(type(default), k, None), property)}
    values = {k: v for k, v in NON_DEFAULT.items() if hasattr(default, k) and k not in derived}
    values["tie_word_embeddings"] = not getattr(default, "tie_word_embeddings", False)
    values.update(NEEDED.get(model_type, {}))
    values.update(PER_TYPE.get(model_type, {}))
    values.update(extra)
    return tiny_twin(AutoConfig.for_model(model_type, **values))


def named_config(name: str):
    from transformers import AutoConfig

    from hf_dist.models.twin import tiny_twin

    model_type, values = NAMED[name]
    return tiny_twin(AutoConfig.for_model(model_type, **values))

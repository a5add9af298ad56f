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


# Hybrid (linear-attention / short-conv / state-space) cases, written out whole because ``tiny_twin`` does not
# shrink their own sizes: the layer pattern, conv kernel, key/value heads, state size and chunk size all differ
# from the defaults, and every kind of layer appears on both sides of the PP=2 cut. Shared with the TP sweep.
_TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}
HYBRID = {
    "qwen3_5_text:deltanet": ("qwen3_5_text", {
        **_TINY, "head_dim": 16, "linear_conv_kernel_dim": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "tie_word_embeddings": True,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}),
    "qwen3_next:dense": ("qwen3_next", {
        **_TINY, "head_dim": 16, "linear_conv_kernel_dim": 2, "linear_key_head_dim": 12, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 0, "tie_word_embeddings": True,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"]}),
    "olmo_hybrid:deltanet": ("olmo_hybrid", {
        **_TINY, "linear_conv_kernel_dim": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_allow_neg_eigval": False,
        "pad_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": True,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}),
    "lfm2:conv": ("lfm2", {
        **_TINY, "conv_L_cache": 4, "conv_bias": True, "tie_word_embeddings": False,
        "block_auto_adjust_ff_dim": False, "layer_types": ["conv", "full_attention", "conv", "full_attention"]}),
    "falcon_h1:mamba2": ("falcon_h1", {
        **_TINY, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 2,
        "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_chunk_size": 8, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False, "embedding_multiplier": 3.0, "lm_head_multiplier": 0.5,
        "key_multiplier": 0.7, "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8,
        "ssm_in_multiplier": 1.2, "ssm_out_multiplier": 0.9, "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.05],
        "mlp_multipliers": [1.1, 0.9], "tie_word_embeddings": True}),
    "bamba:mamba2": ("bamba", {
        **_TINY, "attn_layer_indices": [1, 3], "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2,
        "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_chunk_size": 8, "mamba_proj_bias": True,
        "tie_word_embeddings": True}),
}


def hybrid_config(name: str):
    from transformers import AutoConfig

    model_type, values = HYBRID[name]
    return AutoConfig.for_model(model_type, **values)


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


# Mixture-of-experts cases (tests/test_pp_moe.py): router values away from the defaults, a large aux coefficient.
MOE = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 16,
                  "decoder_sparse_step": 1, "output_router_logits": True, "router_aux_loss_coef": 5.0,
                  "use_sliding_window": True, "sliding_window": 4},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 1, "output_router_logits": True,
                "router_aux_loss_coef": 5.0, "router_jitter_noise": 0.0, "sliding_window": 4},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                "router_aux_loss_coef": 5.0},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                    "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.5,
                    "moe_intermediate_size": 16, "norm_topk_prob": False},
}


def moe_config(model_type: str):
    """A tiny ``model_type`` MoE config with the ``MOE`` router values (4 layers: 2 per stage)."""
    from transformers import AutoConfig

    from hf_dist.models.twin import tiny_twin

    config = tiny_twin(AutoConfig.for_model(model_type, **MOE[model_type]))
    for key, value in MOE[model_type].items():  # tiny_twin must not undo them
        setattr(config, key, value)
    return config


# The layout tests' cases (tests/test_pp_parity.py and the other ``test_pp_*`` files: schedules, PP x DP / TP,
# LoRA, save, eval): what each proves beyond the sweep is named with it. The values are re-applied after
# ``tiny_twin`` (it must not undo them).
LAYOUTS = {
    # grouped-query attention (2 kv heads for 4), untied head (TP x PP refuses tied embeddings), attention bias
    "llama:gqa": ("llama", {"num_key_value_heads": 2, "attention_bias": True, "tie_word_embeddings": False}),
    # the same, tied: the embedding's copy on the last stage (gradients summed between the copies)
    "llama:gqa_tied": ("llama", {"num_key_value_heads": 2, "attention_bias": True, "tie_word_embeddings": True}),
    # fused qkv_proj / gate_up_proj (sharded part by part under TP), a window shorter than SEQ, untied
    "phi3:fused": ("phi3", {"num_key_value_heads": 2, "sliding_window": 8, "intermediate_size": 96,
                            "tie_word_embeddings": False}),
    # OPT as its checkpoints are laid out: tied, LayerNorm before each block and a final one before project_out,
    # pad id 1 (a padding_idx in the tied embedding), positions from the mask's cumsum; a projection
    # (word_embed_proj_dim 16 != hidden) and an MLP width that is not 4 x hidden
    # Gemma-2's logits soft-capped hard (0.5: far from its default 30), its attention windowed, untied
    "gemma2:softcap05": ("gemma2", {"final_logit_softcapping": 0.5, "num_key_value_heads": 2, "sliding_window": 8,
                                    "tie_word_embeddings": False}),
    "opt:projected": ("opt", {"word_embed_proj_dim": 16, "ffn_dim": 96, "tie_word_embeddings": True,
                              "do_layer_norm_before": True, "pad_token_id": 1}),
}


def layout_config(name: str):
    """The ``LAYOUTS`` case ``name``: its model type made tiny (``tiny_twin``: dropout 0) with its values kept."""
    from transformers import AutoConfig

    from hf_dist.models.twin import tiny_twin

    model_type, values = LAYOUTS[name]
    config = tiny_twin(AutoConfig.for_model(model_type, **values))
    for key, value in values.items():
        setattr(config, key, value)
    return config

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
                  "decoder_sparse_step": 1, "output_router_logits": True, "router_aux_loss_coef": 5.0},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 1, "output_router_logits": True,
                "router_aux_loss_coef": 5.0, "router_jitter_noise": 0.0},
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

"""Tiny MoE models with non-default router values, for the expert-parallel parity tests (importable by spawned
ranks). Each has 4 routed experts (2 per rank at ep=2); the aux-loss models turn ``output_router_logits`` on with a
coefficient large enough that a dropped aux term fails the parity check (``test_expert_parallel`` proves it).

One record per model type (``_SPECS``: the config fields beyond ``_COMMON``); adding a type is a row, not a branch.
"""

from __future__ import annotations

VOCAB, HIDDEN, SEQ = 128, 32, 16
AUX = 0.5

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
_GROUPED = dict(n_group=2, topk_group=1)  # each token's experts from one of two groups
_HALF = ["sliding_attention", "full_attention"]
_GATED_DELTA = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=2)

_SPECS: dict[str, dict] = {
    "qwen3_moe": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1),
    "mixtral": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=1),
    "gpt_oss": dict(head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=_HALF),
    # shared expert behind a sigmoid gate; first layer dense (mlp_only_layers)
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                      num_experts=4, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0]),
    "olmoe": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=3, norm_topk_prob=True),
    # router jitter off: random noise has no one-process equal
    "phimoe": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                   input_jitter_noise=0.0),
    "granitemoe": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=3),
    "glm4_moe": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                     num_experts_per_tok=3, n_shared_experts=1, **_GROUPED, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, norm_topk_prob=False, use_qk_norm=True),
    # Mamba mixer in layer 1, attention in layer 0; experts in layer 1 only (period 2)
    "jamba": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=3, expert_layer_period=2,
                  expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_d_conv=2,
                  mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False),
    # two shared experts; the first layer dense (moe_layer_start_index); biases on
    "ernie4_5_moe": dict(intermediate_size=48, moe_intermediate_size=24, moe_num_experts=4, moe_k=3,
                         moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=1,
                         moe_layer_interval=1, use_bias=True),
    # lightning (linear) attention in layer 0, softmax attention in layer 1; residual alpha/beta non-default
    "minimax": dict(head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=3,
                    layer_types=["linear_attention", "full_attention"], block_size=4, full_attn_alpha_factor=0.8,
                    full_attn_beta_factor=1.2, linear_attn_alpha_factor=1.1, linear_attn_beta_factor=0.9,
                    mlp_alpha_factor=0.7, mlp_beta_factor=1.3),
    "flex_olmo": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=3, norm_topk_prob=True),
    # shared MLP beside the experts; Granite's multipliers non-default
    "granitemoeshared": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=3,
                             shared_intermediate_size=40, embedding_multiplier=2.0, logits_scaling=1.5,
                             residual_multiplier=0.7, attention_multiplier=0.3),
    "granitemoe_swa": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=3,
                           shared_intermediate_size=40, layer_types=["full_attention", "sliding_attention"],
                           sliding_window=8),
    "minimax_m2": dict(head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=3),
    "mellum": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_local_experts=4,
                   num_experts_per_tok=3, norm_topk_prob=False, mlp_layer_types=["dense", "sparse"]),
    # router logits soft-capped, routed output scaled, a shared expert
    "laguna": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                   num_experts=4, num_experts_per_tok=3, mlp_layer_types=["dense", "sparse"],
                   moe_routed_scaling_factor=1.5, moe_router_logit_softcapping=5.0),
    "qwen3_next": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, **_GATED_DELTA),
    "qwen3_5_moe_text": dict(head_dim=8, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                             num_experts_per_tok=3, **_GATED_DELTA),
}
_NO_AUX: dict[str, dict] = {
    "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                        **_GROUPED, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
                        norm_topk_prob=False, **_MLA),
    # a shared MLP beside top-2 routing
    "hunyuan_v1_moe": dict(head_dim=8, intermediate_size=24, num_experts=4, moe_topk=2, use_qk_norm=True),
    "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
                        topk_method="group_limited_greedy", **_GROUPED, norm_topk_prob=False, **_MLA),
    "solar_open": dict(head_dim=8, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                       n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False),
    "glm4_moe_lite": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                          n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                          mlp_layer_types=["dense", "sparse"], **_MLA),
    "exaone_moe": dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                       num_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                       mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, layer_types=_HALF,
                       sliding_window=8, sliding_window_pattern=2),
    "mimo_v2_flash": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                          num_experts_per_tok=3, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                          mlp_layer_types=["dense", "sparse"], layer_types=["full_attention", "sliding_attention"],
                          sliding_window=8),
    "kolibri1": dict(head_dim=8, moe_intermediate_size=24, num_local_experts=4, num_experts_per_tok=3,
                     norm_topk_prob=True, shared_expert_intermediate_size=40, layer_types=_HALF, sliding_window=8),
    "afmoe": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                  num_shared_experts=1, num_dense_layers=1, layer_types=_HALF, sliding_window=8),
    "aria_text": dict(intermediate_size=24, moe_num_experts=4, moe_topk=3, moe_num_shared_experts=1),
    "cohere2_moe": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=3, num_shared_experts=1,
                        layer_types=_HALF, sliding_window=8, mlp_layer_types=["sparse", "sparse"]),
    "lfm2_moe": dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                     num_dense_layers=1, use_expert_bias=True, routed_scaling_factor=1.5, norm_topk_prob=False,
                     layer_types=["conv", "full_attention"]),
    "hy_v3": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                  num_shared_experts=1, router_scaling_factor=1.5, mlp_layer_types=["dense", "sparse"]),
    "dots1": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                  n_shared_experts=1, first_k_dense_replace=1, **_GROUPED, routed_scaling_factor=1.5,
                  norm_topk_prob=False),
}
"""Types whose transformers code has no router aux loss (DeepSeek-V3-style routers balance by a score bias)."""


def moe_config(name: str, *, aux: float = AUX):
    """The tiny config of case ``name`` (router aux loss on with coefficient ``aux`` where the type has one)."""
    from transformers import AutoConfig

    if name in _NO_AUX:
        return AutoConfig.for_model(name, **_COMMON, **_NO_AUX[name])
    if name in _SPECS:
        return AutoConfig.for_model(name, **_COMMON, **_SPECS[name], output_router_logits=True,
                                    router_aux_loss_coef=aux)
    raise ValueError(f"no tiny MoE case {name!r}")


CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""EP x FSDP2 and EP x DDP against one process."""
SWEEP_CASES = ("qwen2_moe", "olmoe", "phimoe", "granitemoe", "glm4_moe", "jamba", "ernie4_5_moe", "hunyuan_v1_moe",
               "minimax", "flex_olmo", "granitemoeshared", "granitemoe_swa", "minimax_m2", "mellum", "laguna",
               "qwen3_next", "qwen3_5_moe_text", "deepseek_v2", "solar_open", "glm4_moe_lite", "exaone_moe",
               "mimo_v2_flash", "kolibri1", "afmoe", "aria_text", "cohere2_moe", "lfm2_moe", "hy_v3", "dots1")
"""EP x FSDP2 against one process (the DDP path is the same code, covered by ``CASES``)."""
AUX_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "jamba", "ernie4_5_moe", "minimax", "flex_olmo", "granitemoeshared",
             "granitemoe_swa", "minimax_m2", "mellum", "laguna", "qwen3_next", "qwen3_5_moe_text")
"""Aux-loss cases whose coefficient is checked to move the weights by more than the parity tolerance."""


def moe_model(name: str, *, aux: float = AUX):
    from hf_dist.models.tiny import build_tiny_model

    return build_tiny_model(moe_config(name, aux=aux), seed=0)


def token_batches(steps: int, batch: int, seed: int = 7) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out

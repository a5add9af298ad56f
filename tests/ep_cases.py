"""Tiny MoE models with non-default router values, for the expert-parallel parity tests (importable by spawned
ranks). Each has 4 routed experts (2 per rank at ep=2); the aux-loss models turn ``output_router_logits`` on with a
coefficient large enough that a dropped aux term fails the parity check (``test_expert_parallel`` proves it)."""

from __future__ import annotations

VOCAB, HIDDEN, SEQ = 128, 32, 16
AUX = 0.5


def moe_config(name: str, *, aux: float = AUX):
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    router = dict(output_router_logits=True, router_aux_loss_coef=aux)
    if name == "qwen3_moe":
        return Qwen3MoeConfig(**common, **router, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                              num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1)
    if name == "mixtral":
        return MixtralConfig(**common, **router, intermediate_size=24, num_local_experts=4, num_experts_per_tok=1)
    if name == "gpt_oss":
        return GptOssConfig(**common, **router, head_dim=8, intermediate_size=24, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention",
                                                                                 "full_attention"])
    if name == "deepseek_v3":  # no aux loss in transformers' DeepSeek-V3: its router balances by a score bias
        return DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                first_k_dense_replace=1, routed_scaling_factor=2.0, norm_topk_prob=False,
                                q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                v_head_dim=8)
    if name == "qwen2_moe":  # shared expert behind a sigmoid gate; first layer dense (mlp_only_layers)
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**common, **router, intermediate_size=48, moe_intermediate_size=24,
                              shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=3,
                              norm_topk_prob=True, mlp_only_layers=[0])
    if name == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(**common, **router, intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                           norm_topk_prob=True)
    if name == "phimoe":  # router jitter off: random noise has no one-process equal
        from transformers import PhimoeConfig

        return PhimoeConfig(**common, **router, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                            router_jitter_noise=0.0, input_jitter_noise=0.0)
    if name == "granitemoe":
        from transformers import GraniteMoeConfig

        return GraniteMoeConfig(**common, **router, intermediate_size=24, num_local_experts=4, num_experts_per_tok=3)
    if name == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**common, **router, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                             n_routed_experts=4, num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1,
                             first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=False,
                             use_qk_norm=True)
    if name == "jamba":  # Mamba mixer in layer 1, attention in layer 0; experts in layer 1 only (period 2)
        from transformers import JambaConfig

        return JambaConfig(**common, **router, intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                           expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
                           mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)
    if name == "ernie4_5_moe":  # two shared experts; the first layer dense (moe_layer_start_index)
        from transformers import Ernie4_5_MoeConfig

        return Ernie4_5_MoeConfig(**common, **router, intermediate_size=48, moe_intermediate_size=24,
                                  moe_num_experts=4, moe_k=3, moe_num_shared_experts=2, moe_layer_start_index=1,
                                  moe_layer_end_index=1, moe_layer_interval=1, use_bias=True)
    if name == "hunyuan_v1_moe":  # no aux loss in transformers' HunYuan: a shared MLP beside top-2 routing
        from transformers import HunYuanMoEV1Config

        return HunYuanMoEV1Config(**common, head_dim=8, intermediate_size=24, num_experts=4, moe_topk=2,
                                  use_qk_norm=True)
    if name == "minimax":  # lightning (linear) attention in layer 0, softmax attention in layer 1
        from transformers import MiniMaxConfig

        return MiniMaxConfig(**common, **router, head_dim=8, intermediate_size=24, num_local_experts=4,
                             num_experts_per_tok=3, layer_types=["linear_attention", "full_attention"], block_size=4,
                             full_attn_alpha_factor=0.8, full_attn_beta_factor=1.2, linear_attn_alpha_factor=1.1,
                             linear_attn_beta_factor=0.9, mlp_alpha_factor=0.7, mlp_beta_factor=1.3)
    if name == "flex_olmo":
        from transformers import FlexOlmoConfig

        return FlexOlmoConfig(**common, **router, intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                              norm_topk_prob=True)
    if name == "granitemoeshared":  # shared MLP beside the experts; Granite's multipliers non-default
        from transformers import GraniteMoeSharedConfig

        return GraniteMoeSharedConfig(**common, **router, intermediate_size=24, num_local_experts=4,
                                      num_experts_per_tok=3, shared_intermediate_size=40, embedding_multiplier=2.0,
                                      logits_scaling=1.5, residual_multiplier=0.7, attention_multiplier=0.3)
    raise ValueError(f"no tiny MoE case {name!r}")


CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""EP x FSDP2 and EP x DDP against one process."""
SWEEP_CASES = ("qwen2_moe", "olmoe", "phimoe", "granitemoe", "glm4_moe", "jamba", "ernie4_5_moe", "hunyuan_v1_moe",
               "minimax", "flex_olmo", "granitemoeshared")
"""EP x FSDP2 against one process (the DDP path is the same code, covered by ``CASES``)."""
AUX_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "jamba", "ernie4_5_moe", "minimax", "flex_olmo", "granitemoeshared")


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

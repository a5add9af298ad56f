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
    raise ValueError(f"no tiny MoE case {name!r}")


CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""EP x FSDP2 and EP x DDP against one process."""
SWEEP_CASES = ("qwen2_moe", "olmoe", "phimoe", "granitemoe", "glm4_moe")
"""EP x FSDP2 against one process (the DDP path is the same code, covered by ``CASES``)."""
AUX_CASES = ("qwen3_moe", "mixtral", "gpt_oss")


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

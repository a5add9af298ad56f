"""Tiny MoE models with non-default router values, for the expert-parallel parity tests (importable by spawned
ranks). Each has 4 routed experts (2 per rank at ep=2); the aux-loss models turn ``output_router_logits`` on with a
coefficient large enough that a dropped aux term fails the parity check (``test_expert_parallel`` proves it).

One record per model type (``_SPECS``, ``_NO_AUX``: the config fields beyond, or replacing, ``_COMMON``); adding a type is
a row, not a branch.
"""

from __future__ import annotations

VOCAB, HIDDEN, SEQ = 128, 32, 16
AUX = 0.5

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
_GROUPED = dict(n_group=2, topk_group=1)  # each token's experts from one of two groups
_INDEXER = dict(index_topk=8, index_head_dim=8, index_n_heads=2, num_key_value_heads=4)  # DSA: MLA, kv heads = heads
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
                      num_experts=4, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0],
                      use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "olmoe": dict(intermediate_size=24, num_experts=4, num_experts_per_tok=3, norm_topk_prob=True),
    # router jitter off: random noise has no one-process equal
    "phimoe": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                   input_jitter_noise=0.0, sliding_window=8),
    "granitemoe": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=3),
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
                    layer_types=["linear_attention", "full_attention"], sliding_window=8, block_size=4,
                    full_attn_alpha_factor=0.8,
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
                   moe_routed_scaling_factor=1.5, moe_router_logit_softcapping=5.0, sliding_window=8,
                   layer_types=["full_attention", "sliding_attention"]),
    "qwen3_next": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, **_GATED_DELTA),
    "qwen3_5_moe_text": dict(head_dim=8, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                             num_experts_per_tok=3, **_GATED_DELTA),
    # Gated DeltaNet + QSA-indexed attention, hyper-connections, n-gram embeddings
    "qwen4_exp_text": dict(head_dim=8, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
                           num_experts_per_tok=3, **_GATED_DELTA, hc_count=2, hc_lowrank=8, ple_embed_dim=16,
                           ngram_vocab_size_base=256, split_ngram_parts=4, heads_per_ngram=2, indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2),
    # hash-routed MoE in layer 0 (experts picked by token id), learned routing in layer 1; compressed attention
    "deepseek_v4": dict(moe_intermediate_size=24, head_dim=16, q_lora_rank=16, num_experts_per_tok=3,
                        n_routed_experts=4, n_shared_experts=1, routed_scaling_factor=1.5, hc_mult=2, o_groups=2,
                        o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=8, qk_rope_head_dim=4,
                        sliding_window=8, num_nextn_predict_layers=0, layer_types=["sliding_attention"] * 2,
                        mlp_layer_types=["hash_moe", "moe"]),
    # Mamba2 mixer in layer 0, attention in layer 1; shared MLP beside the experts
    "granitemoehybrid": dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=3,
                             shared_intermediate_size=40, layer_types=["mamba", "attention"], mamba_n_heads=4,
                             mamba_d_state=4, mamba_d_head=16, mamba_d_conv=2, mamba_chunk_size=8),
    "flint": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                  num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0],
                  layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    # block-indexed sparse attention; a dense first layer; shared MLP and scaled routed output
    "minimax_m3_vl_text": dict(intermediate_size=24, head_dim=8, num_experts_per_tok=3, num_local_experts=4,
                               dense_intermediate_size=48, shared_intermediate_size=40, routed_scaling_factor=1.5,
                               rotary_dim=4, mlp_layer_types=["dense", "sparse"], index_n_heads=2, index_head_dim=8,
                               index_block_size=4, index_topk_blocks=2, layer_types=["full_attention"] * 2),
}
_NO_AUX: dict[str, dict] = {
    "glm4_moe": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                     num_experts_per_tok=3, n_shared_experts=1, **_GROUPED, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, norm_topk_prob=False, use_qk_norm=True),
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
                  norm_topk_prob=False, sliding_window=8, max_window_layers=1),
    "axk1": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                 n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                 mlp_layer_types=["dense", "sparse"], **_MLA),
    "axk2": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                 n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                 mlp_layer_types=["dense", "sparse"], **_MLA, **_INDEXER, head_dim=8, gated_norm_rank=4),
    "deepseek_v32": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                         n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                         mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, **_MLA, **_INDEXER),
    "glm_moe_dsa": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                        n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                        mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, **_MLA, **_INDEXER),
    # hyper-connections (hc_mult streams)
    "hy_v4": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                  n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                  mlp_layer_types=["dense", "sparse"], **_MLA, **_INDEXER, head_dim=8, hc_mult=2),
    "dots3_note_text": dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                            n_shared_experts=1, **_GROUPED, routed_scaling_factor=1.5, norm_topk_prob=False,
                            mlp_layer_types=["dense", "sparse"], **_MLA, **_INDEXER, head_dim=8, sliding_window=8,
                            shared_experts_intermediate_size=40),
    "inkling_text": dict(head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                         sliding_window_size=8, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4,
                         num_experts_per_tok=3, n_shared_experts=1, logits_mup_width_multiplier=2.0, route_scale=2.0),
    "inkling2_text": dict(head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                          sliding_window_size=8, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=3,
                          unpadded_vocab_size=VOCAB),
    # Kimi delta attention in layer 0, MLA in layer 1
    "kimi_linear": dict(intermediate_size=48, moe_intermediate_size=24, num_shared_experts=1, routed_scaling_factor=1.5,
                        **_MLA, num_expert_group=2, topk_group=1, num_experts_per_token=3, num_experts=4,
                        mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "full_attention"],
                        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=2, head_dim=8),
    "bailing_hybrid": dict(intermediate_size=48, moe_intermediate_size=24, num_shared_experts=1,
                           routed_scaling_factor=1.5, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                           v_head_dim=8, num_expert_group=2, topk_group=1, num_experts_per_token=3,
                           first_k_dense_replace=1, num_nextn_predict_layers=0, num_experts=4, head_dim=8,
                           layer_group_size=2, layer_types=["linear_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse"], linear_head_dim=8, linear_num_heads=4,
                           linear_conv_kernel_dim=2),
    # non-gated relu2 experts (up_proj/down_proj); Mamba2 mixer, attention and MoE as separate layers
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention", "moe"], num_hidden_layers=4, head_dim=8,
                       intermediate_size=48, use_mamba_kernels=False, ssm_state_size=4, mamba_num_heads=4,
                       mamba_head_dim=8, n_groups=2, conv_kernel=2, chunk_size=8, n_routed_experts=4,
                       n_shared_experts=1, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
                       num_experts_per_tok=3, routed_scaling_factor=1.5, **_GROUPED, norm_topk_prob=False),
    # ZAYA's config accepts num_experts_per_tok=1 only; its router is an MLP (router_hidden_size)
    "zaya": dict(moe_intermediate_size=24, num_experts_per_tok=1, num_experts=4, head_dim=8, router_hidden_size=16,
                 layer_types=["hybrid", "hybrid_sliding"], sliding_window=8),
    "beam": dict(head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=3,
                 norm_topk_prob=False, layer_types=_HALF, sliding_window=8, mlp_layer_types=["dense", "sparse"],
                 **_GROUPED, routed_scaling_factor=1.5),
}
"""Types whose transformers code has no router aux loss (DeepSeek-V3-style routers balance by a score bias)."""
_ADAPTERS = dict(vision_config=dict(adapter_out_dim=HIDDEN), audio_config=dict(adapter_out_dim=HIDDEN))
_WRAPPERS: dict[str, tuple[str, dict]] = {
    "qwen3_5_moe": ("qwen3_5_moe_text", {}),
    "qwen4_exp": ("qwen4_exp_text", {}),
    "dots3_note": ("dots3_note_text", _ADAPTERS),
}
"""Multimodal configs whose causal LM is their text model: the text case inside the wrapper's own config (the model
type the run sees is the wrapper's)."""


_WINDOWS: dict[str, dict] = {"qwen3_moe": dict(use_sliding_window=True, sliding_window=8),
                             "mixtral": dict(sliding_window=8)}
"""A sliding window of 8 < ``SEQ`` for the cases above that leave it at the default (``moe_config(window=True)``)."""


def moe_config(name: str, *, aux: float = AUX, window: bool = False):
    """The tiny config of case ``name`` (router aux loss on with coefficient ``aux`` where the type has one; ``window``:
    the sliding window of ``_WINDOWS`` too)."""
    from transformers import AutoConfig

    if window and name in _WINDOWS:
        return AutoConfig.for_model(name, **{**_COMMON, **_SPECS[name], **_WINDOWS[name]}, output_router_logits=True,
                                    router_aux_loss_coef=aux)
    if name in _WRAPPERS:
        text, extra = _WRAPPERS[name]
        return AutoConfig.for_model(name, text_config=moe_config(text, aux=aux).to_dict(), **extra)
    if name in _NO_AUX:
        return AutoConfig.for_model(name, **{**_COMMON, **_NO_AUX[name]})
    if name in _SPECS:
        return AutoConfig.for_model(name, **{**_COMMON, **_SPECS[name]}, output_router_logits=True,
                                    router_aux_loss_coef=aux)
    raise ValueError(f"no tiny MoE case {name!r}")


CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""EP x FSDP2 and EP x DDP against one process."""
SWEEP_CASES = tuple(sorted((set(_SPECS) | set(_NO_AUX) | set(_WRAPPERS)) - set(CASES)))
"""EP x FSDP2 against one process (the DDP path is the same code, covered by ``CASES``): every other record."""
AUX_CASES = tuple(n for n in CASES + SWEEP_CASES if _WRAPPERS.get(n, (n,))[0] in _SPECS)
"""The aux-loss cases: their coefficient is checked to move the weights by more than the parity tolerance."""


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

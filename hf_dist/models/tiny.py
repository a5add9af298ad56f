"""Tiny Llama-class models built from a config: the CPU twin of the 13B recipe, and the test models.

Nothing is downloaded. The shape keeps everything the real model has that parallelism cares about:
grouped-query attention (kv heads < heads), a gated MLP, RMSNorm, rotary embeddings, untied lm_head.
"""

from __future__ import annotations

import contextlib

import torch


def tiny_llama_config(
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    **overrides,
):
    """A ``LlamaConfig`` small enough to train in seconds on one CPU core."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",
        **overrides,
    )


@contextlib.contextmanager
def _without_zero3_init():
    """Build a whole model even when DeepSpeed ZeRO-3 arguments exist (the engine partitions it later).

    Under ZeRO-3, transformers builds models inside ``deepspeed.zero.Init``, which draws the random init in another
    order: the same seed would give other weights than in a single process.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    config = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def build_tiny_model(config=None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised causal LM from ``config`` (default: ``tiny_llama_config(**config_kwargs)``).

    The same seed gives the same weights in every process and under every layout (ZeRO-3 included), which is
    what parity tests compare against.
    """
    from transformers import AutoModelForCausalLM

    if config is None:
        config = tiny_llama_config(**config_kwargs)
    torch.manual_seed(seed)
    with _without_zero3_init():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model

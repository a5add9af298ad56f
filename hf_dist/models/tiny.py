"""Tiny Llama-class models built from a config: the CPU twin of the 13B recipe, and the test models.

Nothing is downloaded. The shape keeps everything the real model has that parallelism cares about:
grouped-query attention (kv heads < heads), a gated MLP, RMSNorm, rotary embeddings, untied lm_head.
"""

from __future__ import annotations

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


def build_tiny_model(config=None, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised causal LM from ``config`` (default: ``tiny_llama_config(**config_kwargs)``).

    The same seed gives the same weights in every process, which is what parity tests compare against.
    """
    from transformers import AutoModelForCausalLM

    if config is None:
        config = tiny_llama_config(**config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model

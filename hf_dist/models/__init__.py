"""Model helpers: tiny configs for the CPU twin and tests (no download)."""

from hf_dist.models.tiny import tiny_llama_config, build_tiny_model

__all__ = ["tiny_llama_config", "build_tiny_model"]

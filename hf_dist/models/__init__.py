"""Model helpers: tiny configs for the CPU twin and tests, the offline SmolLM2-135M-Instruct directory, LoRA
adapters initialised from the run's seed on every path, and greedy answers."""

from hf_dist.models.adapters import add_adapters
from hf_dist.models.demo_model import demo_model_dir
from hf_dist.models.generation import greedy_answer
from hf_dist.models.tiny import tiny_llama_config, build_tiny_model

__all__ = ["add_adapters", "demo_model_dir", "greedy_answer", "tiny_llama_config", "build_tiny_model"]

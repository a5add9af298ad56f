"""Build an HF causal LM on ``meta`` from a checkpoint directory, ready to be laid out and then filled.

``build_on_meta`` creates the parameters on ``meta`` (buffers such as rotary ``inv_freq`` are computed by the
model's own ``__init__``), re-ties tied weights, and adds LoRA adapters with ``hf_dist.models.adapters`` (PEFT's
own initialisation on the host, from the run's seed, as on the plain path: the same adapters under every layout).
``split_kwargs`` / ``checkpoint_dir`` / ``load_config`` read ``from_pretrained``-style arguments;
``transformers_load`` is the ordinary loader, for DDP and DeepSpeed (under
ZeRO-3 transformers builds the model inside ``deepspeed.zero.Init`` when the DeepSpeed config was registered by
the training arguments, so each rank materialises only its partition).

Not for: the layout (``hf_dist.trainer``), reading the weights (``stream.py``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from hf_dist.models.peft_utils import unwrap_peft

RESOLVE_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")
MODEL_KWARGS = ("attn_implementation", "trust_remote_code")
REFUSED_KWARGS = ("device_map", "quantization_config", "gguf_file", "tp_plan", "tp_size", "distributed_config", "state_dict")


def checkpoint_dir(name_or_dir: str | os.PathLike, resolve: dict) -> str:
    path = os.fspath(name_or_dir)
    if os.path.isdir(path):
        return os.path.join(path, resolve["subfolder"]) if resolve.get("subfolder") else path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **resolve)


def split_kwargs(kwargs: dict) -> tuple[dict, dict, object, dict]:
    refused = [k for k in kwargs if k in REFUSED_KWARGS]
    if refused:
        raise ValueError(
            f"hf_dist.from_pretrained does not take {refused}: the layout comes from the DistTrainingArguments; "
            f"drop them (or load with transformers' from_pretrained and pass the model to DistTrainer)"
        )
    resolve = {k: kwargs.pop(k) for k in RESOLVE_KWARGS if k in kwargs}
    model_kwargs = {k: kwargs.pop(k) for k in MODEL_KWARGS if k in kwargs}
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    return resolve, model_kwargs, dtype, kwargs


def load_config(directory: str, model_kwargs: dict, overrides: dict):
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(
        directory, return_unused_kwargs=True, trust_remote_code=model_kwargs.get("trust_remote_code", False),
        **overrides,
    )
    if unused:
        raise ValueError(f"unknown from_pretrained arguments {sorted(unused)}: neither loader options nor config fields")
    return config


def build_on_meta(config, dtype: torch.dtype, model_kwargs: dict, peft_config=None, seed: int = 0) -> nn.Module:
    """The causal LM of ``config`` with its parameters on ``meta`` (buffers computed), adapters initialised."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    model.tie_weights()  # one Parameter for tied embeddings, as from_pretrained leaves them
    model.eval()  # as from_pretrained returns it
    if peft_config is not None:
        from hf_dist.models.adapters import add_adapters

        model = add_adapters(model, peft_config, seed=seed)
    return model


def load_generation_config(model: nn.Module, directory: str) -> None:
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        target = unwrap_peft(model)
        target.generation_config = GenerationConfig.from_pretrained(directory)


def transformers_load(
    directory: str, dtype, model_kwargs: dict, overrides: dict, peft_config, seed: int
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **model_kwargs, **overrides)
    if peft_config is not None:
        from hf_dist.models.adapters import add_adapters

        model = add_adapters(model, peft_config, seed=seed)  # as build_on_meta: the same adapters on every path
    return model

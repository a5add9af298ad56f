"""``hf_dist.from_pretrained``: an HF causal LM loaded straight into the layout of a ``DistTrainingArguments``.

For the layouts hf_dist owns (FSDP2, TP, PP and their products) the model is built on ``meta`` (parameters
only: buffers such as rotary ``inv_freq`` are computed by the model's own ``__init__``), LoRA adapters are
added and initialised by PEFT on the host (they are small), the layout is applied by the same function
``DistTrainer`` uses, and each rank then reads only its own slices of the safetensors files
(``stream.load_checkpoint``). No rank ever holds the whole model. The result carries a mark, so ``DistTrainer``
uses it as it is.

DDP and DeepSpeed keep transformers' loader: every DDP rank needs the whole model anyway, and under ZeRO-3
transformers builds the model inside ``deepspeed.zero.Init`` (the ``DistTrainingArguments`` registered the
DeepSpeed config when they were created), so each rank materialises only its partition.

Not for: the layout itself, or reading checkpoints written by hf_dist's own trainer (``hf_dist.checkpoint``).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from hf_dist.trainer.laid_out import LaidOut, stamp

logger = logging.getLogger(__name__)

_RESOLVE_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")
_MODEL_KWARGS = ("attn_implementation", "trust_remote_code")
_REFUSED = ("device_map", "quantization_config", "gguf_file", "tp_plan", "tp_size", "distributed_config", "state_dict")


def _checkpoint_dir(name_or_dir: str | os.PathLike, resolve: dict) -> str:
    path = os.fspath(name_or_dir)
    if os.path.isdir(path):
        return os.path.join(path, resolve["subfolder"]) if resolve.get("subfolder") else path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **resolve)


def _split_kwargs(kwargs: dict) -> tuple[dict, dict, object, dict]:
    refused = [k for k in kwargs if k in _REFUSED]
    if refused:
        raise ValueError(
            f"hf_dist.from_pretrained does not take {refused}: the layout comes from the DistTrainingArguments; "
            f"drop them (or load with transformers' from_pretrained and pass the model to DistTrainer)"
        )
    resolve = {k: kwargs.pop(k) for k in _RESOLVE_KWARGS if k in kwargs}
    model_kwargs = {k: kwargs.pop(k) for k in _MODEL_KWARGS if k in kwargs}
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    return resolve, model_kwargs, dtype, kwargs


def layout_dtype(args, *, lora: bool) -> torch.dtype:
    """The dtype the layout keeps: fp32 master weights for a full fine-tune; the 16-bit compute dtype for a
    frozen LoRA base, and for pipeline stages (they do not autocast)."""
    half = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return half if half is not None and (lora or args.pp_size > 1) else torch.float32


def _as_dtype(dtype, args, lora: bool) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return layout_dtype(args, lora=lora)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _load_config(directory: str, model_kwargs: dict, overrides: dict):
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(
        directory, return_unused_kwargs=True, trust_remote_code=model_kwargs.get("trust_remote_code", False),
        **overrides,
    )
    if unused:
        raise ValueError(f"unknown from_pretrained arguments {sorted(unused)}: neither loader options nor config fields")
    return config


def _init_adapters(model: nn.Module, peft_config, seed: int) -> None:
    """PEFT's own initialisation for every LoRA adapter, on the host, identical on every rank (seeded)."""
    init = getattr(peft_config, "init_lora_weights", True)
    if init not in (True, False, "gaussian") or getattr(peft_config, "use_dora", False):
        raise ValueError(
            f"init_lora_weights={init!r}, use_dora={getattr(peft_config, 'use_dora', False)}: these adapters are "
            f"computed from the base weights, which a meta-device load does not hold; use init_lora_weights=True "
            f"or 'gaussian' without DoRA, or transformers' from_pretrained"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A"):
                for adapter in list(module.lora_A.keys()):
                    module.lora_A[adapter].to_empty(device="cpu")
                    module.lora_B[adapter].to_empty(device="cpu")
                    module.reset_lora_parameters(adapter, init)
    left = [n for n, p in model.named_parameters() if p.requires_grad and p.is_meta]
    if left:
        raise ValueError(f"adapter parameters {left[:4]} have no initialisation on a meta model; use a LoRA config")


def build_on_meta(config, dtype: torch.dtype, model_kwargs: dict, peft_config=None, seed: int = 0) -> nn.Module:
    """The causal LM of ``config`` with its parameters on ``meta`` (buffers computed), adapters initialised."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    model.tie_weights()  # one Parameter for tied embeddings, as from_pretrained leaves them
    model.eval()  # as from_pretrained returns it
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
        _init_adapters(model, peft_config, seed)
    return model


def from_pretrained(name_or_dir: str | os.PathLike, args, *, peft_config=None, **from_pretrained_kwargs) -> nn.Module:
    """Load ``name_or_dir`` laid out for ``args`` (a ``DistTrainingArguments``, read under the launcher).

    Args:
        name_or_dir: a local directory with safetensors weights, or a Hub name already in the local cache.
        args: the arguments you pass to ``DistTrainer``; their layout (FSDP2 / TP / PP, dtype) is applied here.
        peft_config: a PEFT ``LoraConfig`` to add adapters before the layout (as ``get_peft_model`` would).
        from_pretrained_kwargs: ``dtype`` (default: what the layout keeps, ``layout_dtype``),
            ``attn_implementation``, ``trust_remote_code``, Hub options, and config overrides.

    Returns the model ready for ``DistTrainer(model=..., args=args)``; for DDP and DeepSpeed, transformers'
    own ``from_pretrained`` (plus ``get_peft_model``).
    """
    from hf_dist.planner.flops import module_flop_counts
    from hf_dist.trainer.trainer import apply_owned_layout, trainer_dims

    resolve, model_kwargs, dtype, overrides = _split_kwargs(dict(from_pretrained_kwargs))
    directory = _checkpoint_dir(name_or_dir, resolve)
    dtype = _as_dtype(dtype, args, lora=peft_config is not None)
    dims = trainer_dims(args)
    if args.hf_dist_fsdp is None and not dims.tp_enabled and not dims.pp_enabled:
        return _transformers_load(directory, dtype, model_kwargs, overrides, peft_config)
    config = _load_config(directory, model_kwargs, overrides)
    if args.pp_size > 1:
        from hf_dist.pipeline_parallel.support import check_pipeline_support

        check_pipeline_support(config)  # before any process group
    device = args.device  # starts the process group
    model = build_on_meta(config, dtype, model_kwargs, peft_config, seed=args.seed)
    flops = module_flop_counts(model)  # of the whole model, before a pipeline rank drops other stages
    _load_generation_config(model, directory)
    model = apply_owned_layout(model, args, dims)
    from hf_dist.loading.stream import load_checkpoint

    offload = args.hf_dist_fsdp is not None and args.hf_dist_fsdp.cpu_offload
    load_checkpoint(model, directory, device="cpu" if offload else device)  # FSDP2 offload keeps shards on the host
    return stamp(model, LaidOut(dims=dims, fsdp=args.hf_dist_fsdp is not None, flops=flops))


def _load_generation_config(model: nn.Module, directory: str) -> None:
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        target = model.get_base_model() if hasattr(model, "get_base_model") else model
        target.generation_config = GenerationConfig.from_pretrained(directory)


def _transformers_load(directory: str, dtype, model_kwargs: dict, overrides: dict, peft_config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **model_kwargs, **overrides)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model

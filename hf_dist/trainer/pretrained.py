"""``hf_dist.from_pretrained``: an HF causal LM loaded straight into the layout of a ``DistTrainingArguments``.

For the layouts hf_dist owns (FSDP2, TP, PP and their products) the model is built on ``meta``
(``hf_dist.loading.meta``), laid out by ``apply_owned_layout`` (the function ``DistTrainer`` uses), and each rank
then reads only its own slices of the safetensors files (``hf_dist.loading.stream_weights``). No rank ever holds
the whole model. The result carries a mark (``laid_out.py``), so ``DistTrainer`` uses it as it is.
DDP and DeepSpeed keep transformers' loader (every DDP rank needs the whole model; ZeRO-3 goes through
``deepspeed.zero.Init``, see ``hf_dist/loading/README.md``).

Not for: the loading mechanics (``hf_dist.loading``) or checkpoints written by hf_dist's trainer (``hf_dist.checkpoint``).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from hf_dist.internals import check_internals
from hf_dist.loading import meta, stream_weights
from hf_dist.loading.checkpoint_files import CheckpointFiles
from hf_dist.loading.key_map import KeyMap, key_map
from hf_dist.models.peft_utils import unwrap_peft
from hf_dist.trainer.laid_out import LaidOut, stamp
from hf_dist.trainer.model_support import check_model_support

logger = logging.getLogger(__name__)


def layout_dtype(args, *, lora: bool) -> torch.dtype:
    """The dtype the layout keeps: fp32 master weights for a full fine-tune; the 16-bit compute dtype for a
    frozen LoRA base, and for pipeline stages (they do not autocast)."""
    half = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return half if half is not None and (lora or args.layout.pp > 1) else torch.float32


def _as_dtype(dtype, args, lora: bool) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return layout_dtype(args, lora=lora)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _names_or_none(model: nn.Module, directory: str) -> KeyMap | None:
    """Checkpoint name of every model tensor, or None (with a warning) when transformers must split some stored
    tensor into several model tensors (a converter with several targets; the streaming load builds a tensor from
    several stored ones, not several from one)."""
    base = unwrap_peft(model)
    names = key_map(base, CheckpointFiles(directory).keys())
    if not names.unsupported:
        return names
    logger.warning(
        "%s: the checkpoint in %r stores %d tensors that transformers splits into several model tensors while "
        "loading (%s); the streaming load does not split stored tensors, so this model is loaded with "
        "transformers' from_pretrained on every rank (each rank holds the whole model until the layout shards it)",
        base.config.model_type, directory, len(names.unsupported), names.describe_assembly(unsupported=True),
    )
    return None


def from_pretrained(name_or_dir: str | os.PathLike, args, *, peft_config=None, **from_pretrained_kwargs) -> nn.Module:
    """Load ``name_or_dir`` laid out for ``args`` (a ``DistTrainingArguments``, read under the launcher).

    Args:
        name_or_dir: a local directory with safetensors weights, or a Hub name already in the local cache.
        args: the arguments you pass to ``DistTrainer``; their layout (FSDP2 / TP / PP, dtype) is applied here.
        peft_config: a PEFT ``LoraConfig`` to add adapters before the layout (``hf_dist.models.add_adapters``:
            ``get_peft_model`` with the adapters drawn from ``args.seed``, the same under every layout).
        from_pretrained_kwargs: ``dtype`` (default: what the layout keeps, ``layout_dtype``),
            ``attn_implementation``, ``trust_remote_code``, Hub options, and config overrides.

    Returns the model ready for ``DistTrainer(model=..., args=args)``; for DDP and DeepSpeed, transformers'
    own ``from_pretrained`` (plus ``add_adapters``). Checkpoint names are mapped by transformers' own renaming
    rules (``hf_dist.loading.key_map``); a tensor transformers assembles from several stored ones (per-expert MoE
    weights, e.g. Mixtral) is built by transformers' converter one tensor at a time and its slices kept. A
    checkpoint where transformers splits one stored tensor into several is loaded with transformers on every
    rank, with a warning, and laid out by DistTrainer.
    """
    from hf_dist.planner.flops import module_flop_counts
    from hf_dist.trainer.layout import apply_owned_layout

    check_internals()  # before any weight loads: a private member the loader or the layouts rely on is gone
    resolve, model_kwargs, dtype, overrides = meta.split_kwargs(dict(from_pretrained_kwargs))
    directory = meta.checkpoint_dir(name_or_dir, resolve)
    dtype = _as_dtype(dtype, args, lora=peft_config is not None)
    dims = args.layout.dims  # the run's one Layout, resolved by DistTrainingArguments
    config = meta.load_config(directory, model_kwargs, overrides)
    lora_rank = (getattr(peft_config, "r", 1) or 1) if peft_config is not None else 0
    check_model_support(config, args, lora_rank)  # from the config alone: before any weight loads or process group
    if not args.layout.streaming_load:
        return meta.transformers_load(directory, dtype, model_kwargs, overrides, peft_config, args.seed)
    device = args.device  # starts the process group
    model = meta.build_on_meta(config, dtype, model_kwargs, peft_config, seed=args.seed)
    names = _names_or_none(model, directory)
    if names is None:  # transformers must split stored tensors: the streaming load does not
        return meta.transformers_load(directory, dtype, model_kwargs, overrides, peft_config, args.seed)
    flops = module_flop_counts(model)  # of the whole model, before a pipeline rank drops other stages
    meta.load_generation_config(model, directory)
    model = apply_owned_layout(model, args, dims)
    offload = args.hf_dist_fsdp is not None and args.hf_dist_fsdp.cpu_offload
    report = stream_weights(model, directory, device="cpu" if offload else device, names=names)  # offload: host
    fsdp = args.hf_dist_fsdp
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)  # a tied head is in the root always
    return stamp(model, LaidOut(dims=dims, fsdp=fsdp is not None, flops=flops, load=report,
                                head_unit=None if fsdp is None or tied else fsdp.head_unit))

"""Write a laid-out model as a normal HF safetensors directory, one tensor gathered at a time.

``save_streaming`` walks the model's state dict in order; each DTensor is made whole (a collective every rank
joins), fused projections are put back in HF row order, and rank 0 keeps it only until the current file reaches
``max_shard_bytes``, then writes that file and drops it. Rank 0's extra memory is therefore one file plus one
tensor, never the whole model (the full-state-dict path held all of it). The shards are planned from the global
shapes before any gather, so the file names (``model-0000i-of-0000n.safetensors``) and the index are exact.

Not for: PEFT adapters (small: the gathered path writes them), pipeline stages (each pp rank holds other
tensors; ``hf_dist.pipeline_parallel.checkpoint``), or resumable checkpoints (``hf_dist.checkpoint``, DCP).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dist.loading.stream import _tied_sources
from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR, deinterleave_parts

DEFAULT_SHARD_BYTES = 2**30


def _fused_parts(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    out = {}
    for name, module in model.named_modules():
        fused = getattr(module, FUSED_PARTS_ATTR, None)
        if fused is not None:
            for param_name, _ in module.named_parameters(recurse=False):
                out[f"{name}.{param_name}" if name else param_name] = fused
    return out


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive keys grouped into files of at most ``max_shard_bytes`` (a larger tensor gets a file alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def save_streaming(model: nn.Module, save_directory: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write ``model``'s weights and config to ``save_directory`` from rank 0; every rank must call this."""
    from safetensors.torch import save_file

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    state = model.state_dict()
    tied = _tied_sources(model)
    state = {k: v for k, v in state.items() if not (k in tied and tied[k] in state)}  # as save_pretrained drops them
    fused = _fused_parts(model)
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = _file_names(len(shards))
    if is_main:
        os.makedirs(save_directory, exist_ok=True)
    for keys, name in zip(shards, names):
        part: dict[str, torch.Tensor] = {}
        for key in keys:
            value = state[key].detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()  # collective over the tensor's mesh
            if key in fused:
                value = deinterleave_parts(value, *fused[key])
            if is_main:
                part[key] = value.to("cpu", copy=True).contiguous()
            del value
        if is_main:
            save_file(part, os.path.join(save_directory, name), metadata={"format": "pt"})
        del part
    if is_main:
        _write_metadata(model, save_directory, shards, names, sum(sizes.values()))
    if dist.is_initialized():
        dist.barrier()


def _hf_class(model: nn.Module) -> type:
    from transformers import PreTrainedModel

    return next(c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP"))


def _write_metadata(model: nn.Module, directory: str, shards: list[list[str]], names: list[str], total: int) -> None:
    if len(names) > 1:
        weight_map = {key: name for keys, name in zip(shards, names) for key in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    model.config.architectures = [_hf_class(model).__name__]  # not FSDP2's FSDP<Class> wrapper class
    model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(directory)

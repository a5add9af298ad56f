"""Gather a parallelised model back into ordinary tensors in HF layout: the one full-state-dict gatherer.

``full_state_dict`` turns every DTensor (FSDP2 shards, TP shards, both) into a whole tensor and puts fused
projections that TP interleaved back in HF row order; every rank calls it (the gathers are collectives) and gets
the same dict. ``DistTrainer._save``, ``save_gathered`` and the pipeline's saver (per stage, then over the pipeline
group) all use it. ``save_gathered`` writes a normal HF directory (or a PEFT adapter directory) from rank 0;
``save_streaming`` writes one the same way but gathers one tensor at a time, so rank 0 holds one file plus one
tensor, never the whole model (shards planned from the global shapes first, so names and index are exact).

Not for: sharded checkpoints for resuming (``hf_dist.checkpoint``, DCP), or models too large for one host's memory.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR, deinterleave_parts

DEFAULT_SHARD_BYTES = 2**30


def _fused_keys(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    keys = {}
    for name, module in model.named_modules():
        fused = getattr(module, FUSED_PARTS_ATTR, None)
        if fused is None:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            keys[f"{name}.{param_name}" if name else param_name] = fused
    return keys


def _whole(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value
    mesh_device = value.device_mesh.device_type
    if value.device.type != mesh_device:  # FSDP CPU offload: shards on CPU, collectives on the mesh's device
        value = value.to(mesh_device)
    return value.full_tensor()


def _hf_layout(key: str, value: torch.Tensor, fused: dict) -> torch.Tensor:
    """One state-dict entry whole and in HF row order (collective when it is a DTensor)."""
    value = _whole(value)
    if key in fused:
        parts, tp = fused[key]
        value = deinterleave_parts(value, parts, tp)
    return value


def full_state_dict(model: nn.Module, *, cpu: bool = True, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()`` whole, in HF layout (collective over the model's meshes).

    ``cpu``: return CPU copies (never views of live parameters). ``trainable_only``: only parameters that
    require grad (a LoRA adapter), buffers and frozen weights left out.
    """
    fused = _fused_keys(model)
    keep = {name for name, p in model.named_parameters() if p.requires_grad} if trainable_only else None
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if keep is not None and key not in keep:
            continue
        value = _hf_layout(key, value, fused)
        out[key] = value.detach().to("cpu", copy=True) if cpu else value.detach()
    return out


def save_gathered(model: nn.Module, save_directory: str, **save_kwargs) -> None:
    """Write ``model`` (an HF model or a ``PeftModel``, parallelised or not) as a normal directory from rank 0.

    A ``PeftModel`` writes its adapter only; an HF model writes all weights and its config. Every rank must call
    this (the gather is collective); it returns after a barrier, so the files exist on every rank's return.
    """
    state = full_state_dict(model)
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main:
        model.save_pretrained(save_directory, state_dict=state, is_main_process=True, **save_kwargs)
    if dist.is_initialized():
        dist.barrier()


def tied_sources(model: nn.Module) -> dict[str, str]:
    """``{tied key: source key}`` from the HF model's ``_tied_weights_keys`` when its config ties weights."""
    for module in model.modules():
        keys = getattr(type(module), "_tied_weights_keys", None)
        config = getattr(module, "config", None)
        if isinstance(keys, dict) and getattr(config, "tie_word_embeddings", False):
            return dict(keys)
    source = getattr(getattr(model, "pipeline", None), "source_model", None)
    return tied_sources(source) if source is not None and source is not model else {}


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
    tied = tied_sources(model)
    state = {k: v for k, v in state.items() if not (k in tied and tied[k] in state)}  # as save_pretrained drops them
    fused = _fused_keys(model)
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = _file_names(len(shards))
    if is_main:
        os.makedirs(save_directory, exist_ok=True)
    for keys, name in zip(shards, names):
        part: dict[str, torch.Tensor] = {}
        for key in keys:
            value = _hf_layout(key, state[key].detach(), fused)  # collective over the tensor's mesh
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

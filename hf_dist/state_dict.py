"""Gather a parallelised model back into ordinary tensors in HF layout: the one full-state-dict gatherer.

``full_state_dict`` turns every DTensor (FSDP2 shards, TP shards, both) into a whole tensor and puts fused
projections that TP interleaved back in HF row order; every rank calls it (the gathers are collectives) and gets
the same dict. ``DistTrainer._save``, ``save_gathered`` and the pipeline's saver (per stage, then over the pipeline
group) all use it. ``save_gathered`` writes a normal HF directory (or a PEFT adapter directory) from rank 0.

Not for: sharded checkpoints for resuming (``hf_dist.checkpoint``, DCP), or models too large for one host's memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR, deinterleave_parts


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
        value = _whole(value)
        if key in fused:
            parts, tp = fused[key]
            value = deinterleave_parts(value, parts, tp)
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

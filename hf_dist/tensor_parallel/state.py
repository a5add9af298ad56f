"""Gather a tensor-parallel (and FSDP2-sharded) model back into ordinary tensors, in HF layout.

``full_state_dict`` returns the model's state dict with every DTensor gathered (collective: every rank
calls it) and fused projections put back in HF row order; ``save_gathered`` writes a normal HF directory
(or a PEFT adapter directory) from one rank. Not for: sharded checkpoints for resuming (use DCP).
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


def full_state_dict(model: nn.Module, *, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()`` whole, in HF layout. Collective over all ranks of the mesh."""
    fused = _fused_keys(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if key in fused:
            parts, tp = fused[key]
            value = deinterleave_parts(value, parts, tp)
        out[key] = value.detach().to("cpu").clone() if cpu else value.detach()
    return out


def save_gathered(model: nn.Module, save_directory: str, **save_kwargs) -> None:
    """Write ``model`` (an HF model or a ``PeftModel``) as a normal directory from global rank 0.

    A ``PeftModel`` writes its adapter only, gathered; an HF model writes all weights and its config.
    Every rank must call this (the gather is collective).
    """
    state = full_state_dict(model)
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main:
        model.save_pretrained(save_directory, state_dict=state, is_main_process=True, **save_kwargs)
    if dist.is_initialized():
        dist.barrier()

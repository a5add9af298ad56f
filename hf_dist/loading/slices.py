"""Which block of a checkpoint tensor a rank's local shard holds, and how its name maps to the checkpoint.

``local_blocks`` answers "which rows and columns of the HF tensor go where in my local tensor" for a plain
tensor (everything), a DTensor (torch's own ``compute_local_shape_and_global_offset``, the rule DCP uses for
its checkpoints: the local shard is one block at an offset, FSDP2 over TP's ``_StridedShard`` included), and a
fused projection sharded by ``FusedColwiseParallel`` (the DTensor's rows are in rank-major order; each run of
consecutive HF rows is read on its own). A DTensor with a ``_StridedShard`` placement on its own dimension (MoE
experts' fused ``[gate | up]`` under TP, ``tensor_parallel/moe.py``: rank r holds ``[gate_r | up_r]``, not one
block) is read run by run: torch's own split of each dimension's indices says which HF rows the rank holds. ``checkpoint_key`` strips what wrappers add to parameter names.

Not for: reading files (``checkpoint_files.py``) or walking a model (``stream.py``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hf_dist.tensor_parallel.styles import interleave_parts

Index = tuple[slice, ...]

PEFT_PREFIX = "base_model.model."
WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base_layer"})
"""Path components added by activation checkpointing, torch.compile, FSDP1 and PEFT's LoRA layers."""


def checkpoint_key(fqn: str) -> str:
    """The HF checkpoint name of parameter ``fqn`` of a laid-out model (PEFT and wrapper parts removed)."""
    if fqn.startswith(PEFT_PREFIX):
        fqn = fqn[len(PEFT_PREFIX):]
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_NAMES)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank writes into: a DTensor's local shard, or the tensor itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _global_block(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(param, DTensor):
        return tuple(param.shape), (0,) * param.ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def _runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, source start, length)`` for each run of consecutive values in ``rows``."""
    runs: list[tuple[int, int, int]] = []
    for local, source in enumerate(rows.tolist()):
        if runs and runs[-1][1] + runs[-1][2] == source and runs[-1][0] + runs[-1][2] == local:
            start, src, length = runs[-1]
            runs[-1] = (start, src, length + 1)
        else:
            runs.append((local, source, 1))
    return runs


def _splits(placement) -> bool:
    return hasattr(placement, "dim") and hasattr(placement, "_split_tensor")  # Shard, _StridedShard


def multi_block(param: torch.Tensor) -> bool:
    """Whether this rank's shard of ``param`` is several blocks of the whole tensor (a ``_StridedShard`` on a
    dimension nothing else shards: MoE experts' ``[gate_r | up_r]`` under TP), which DTensor's own checkpoint
    hooks describe as one block (``checkpoint.blocks`` writes and reads it block by block)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor) or not any(isinstance(p, _StridedShard) for p in param.placements):
        return False
    dims = [p.dim % param.ndim for p in param.placements if _splits(p)]
    return len(dims) == len(set(dims))  # FSDP2 over TP on one dimension: torch's one block (``_global_block``)


def strided_blocks(param: DTensor) -> list[tuple[Index, Index]]:
    """Blocks of a DTensor with a ``_StridedShard`` (each dimension sharded at most once): per dimension, the HF
    indices this rank holds (each placement's own ``_split_tensor`` applied to ``arange``), read in runs."""
    import itertools

    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    indices = [torch.arange(n) for n in param.shape]
    for mesh_dim, placement in enumerate(param.placements):
        if _splits(placement):
            dim = placement.dim % param.ndim
            along = indices[dim].view([-1 if k == dim else 1 for k in range(param.ndim)])
            chunks, _ = placement._split_tensor(along, mesh.size(mesh_dim), with_padding=False)
            indices[dim] = chunks[coordinate[mesh_dim]].reshape(-1)
    if tuple(len(i) for i in indices) != tuple(local_tensor(param).shape):
        raise RuntimeError(f"local shard {tuple(local_tensor(param).shape)} does not match the strided split of "
                           f"{tuple(param.shape)} over {param.placements}")
    per_dim = [[(slice(a, a + n), slice(b, b + n)) for a, b, n in _runs(i)] for i in indices]
    return [tuple(zip(*combo)) for combo in itertools.product(*per_dim)]


def local_blocks(param: torch.Tensor, fused: tuple[tuple[int, ...], int] | None = None) -> list[tuple[Index, Index]]:
    """``(index into the local tensor, index into the HF tensor)`` pairs that together fill this rank's shard.

    ``fused`` is ``(part row counts, tp)`` for a ``FusedColwiseParallel`` Linear (``styles.FUSED_PARTS_ATTR``).
    """
    if multi_block(param) and fused is None:
        return strided_blocks(param)
    shape, offset = _global_block(param)
    local = local_tensor(param)
    if tuple(local.shape) != shape:
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the block {shape} torch computes for {param.shape}")
    block = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    whole = tuple(slice(None) for _ in shape)
    if fused is None or not shape or shape[0] == 0:
        return [(whole, block)]
    parts, tp = fused
    order = interleave_parts(torch.arange(sum(parts)), parts, tp)[offset[0] : offset[0] + shape[0]]
    return [
        ((slice(start, start + length), *whole[1:]), (slice(src, src + length), *block[1:]))
        for start, src, length in _runs(order)
    ]

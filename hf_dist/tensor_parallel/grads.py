"""Partial gradients of replicated TP parameters, summed once per optimizer step in one collective per mesh dim.

Under sequence parallelism the norms run on this rank's sequence shard with their weight whole (``Replicate``), so
each weight's gradient is a partial sum per rank (a DTensor with a ``Partial`` placement). Left so, every
consumer redistributes it tensor by tensor: the optimizer step and the gradient norm each issued one all-reduce per
norm weight (the step ledger, ``tests/test_ledger.py``). ``reduce_partial_grads`` sums them all in one flat
all-reduce per (mesh dimension, dtype) instead, and leaves each gradient with its parameter's placements -- what
Megatron does with its sequence-parallel norm gradients. Accumulated micro steps add partial sums, so once per
optimizer step (before the norm and the step) is enough.

Gradients another mechanism reduces (FSDP2's reduce-scatter, a parameter's own hook) are no longer partial by
then and are left alone. Not for: data-parallel averaging (``hf_dist.data_parallel``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial


def _partial_dims(param: nn.Parameter) -> tuple[int, ...] | None:
    """The mesh dims where ``param``'s gradient is a ``Partial("sum")`` the parameter is not; None: not reducible
    here (no DTensor, nothing partial, or another reduce op)."""
    grad = param.grad
    if not isinstance(param, DTensor) or not isinstance(grad, DTensor) or grad.device_mesh != param.device_mesh:
        return None
    dims = []
    for dim, (have, want) in enumerate(zip(grad.placements, param.placements)):
        if have.is_partial() and not want.is_partial():
            if have != Partial("sum") or not want.is_replicate():
                return None
            dims.append(dim)
    return tuple(dims) or None


def reduce_partial_grads(params: Iterable[nn.Parameter]) -> int:
    """Sum every partial gradient among ``params`` over the ranks it is partial on, one all-reduce per (mesh,
    partial dims, dtype); returns how many gradients it reduced (0: nothing to do, no collective)."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        dims = _partial_dims(param)
        if dims is not None:
            key = (param.device_mesh, tuple(param.grad.placements), dims, param.grad.dtype)
            groups.setdefault(key, []).append(param)
    for (mesh, _, dims, _), members in groups.items():
        locals_ = [p.grad.to_local() for p in members]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        for param, values in zip(members, flat.split([g.numel() for g in locals_])):
            reduced = values.view_as(param.grad.to_local())
            param.grad = DTensor.from_local(reduced, mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
    return sum(len(m) for m in groups.values())

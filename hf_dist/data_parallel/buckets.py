"""Gradient buckets: which gradients travel together in one all-reduce, and how they are packed.

A bucket is a run of parameters of one dtype on one device whose local gradients fit in about ``cap_bytes``;
its gradients are copied into one flat buffer, reduced in one collective over the data-parallel group and
copied back. TP-sharded parameters (DTensors) contribute their local shard: every rank of a dp group holds the
same tp coordinate, so the shards reduced together are shards of the same slice, whatever their placement, and
plain and sharded parameters may share a bucket. The dp group is the same for every parameter of a model
(``replicate`` takes one mesh), so dtype and device are the whole bucket key.

Each buffer ends with one presence flag per parameter (1 where this rank has a gradient): a parameter that got
no gradient on this rank (unused in its forward) counts as zeros in the sum, and one that got none on any rank
keeps ``grad=None`` -- as in one process, where the optimizer skips it -- at no extra collective.

Not here: when buckets are reduced (``hf_dist.data_parallel.reducer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_MB = 25.0
"""Bucket size in MiB (torch DDP's default ``bucket_cap_mb``)."""


def local_shape(param: nn.Parameter) -> torch.Size:
    """The shape of this rank's part of ``param``: its local shard for a DTensor."""
    return param._local_tensor.shape if isinstance(param, DTensor) else param.shape


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of ``param.grad`` (the local shard of a DTensor gradient), or None."""
    grad = param.grad
    return grad._local_tensor if isinstance(grad, DTensor) else grad


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are reduced together, in their order in the flat buffer."""

    params: tuple[nn.Parameter, ...]
    dtype: torch.dtype
    numel: int
    """Gradient elements in the buffer (the presence flags follow them)."""

    @property
    def device(self) -> torch.device:
        first = self.params[0]
        return first._local_tensor.device if isinstance(first, DTensor) else first.device

    def flatten(self) -> torch.Tensor:
        """A new buffer: every local gradient (zeros where None), then one presence flag per parameter."""
        flat = torch.zeros(self.numel + len(self.params), dtype=self.dtype, device=self.device)
        offset = 0
        for i, param in enumerate(self.params):
            grad, n = local_grad(param), local_shape(param).numel()
            if grad is not None:
                flat[offset : offset + n].copy_(grad.reshape(-1))
                flat[self.numel + i] = 1
            offset += n
        return flat

    def unflatten(self, flat: torch.Tensor, divisor: int) -> None:
        """Write the reduced buffer (divided by ``divisor``) back into the gradients; create those that some rank
        had and this one lacked, leave None those no rank had."""
        if divisor != 1:
            flat[: self.numel].div_(divisor)
        offset = 0
        for i, param in enumerate(self.params):
            shape = local_shape(param)
            values = flat[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
            grad = local_grad(param)
            if grad is not None:
                grad.copy_(values)
            elif flat[self.numel + i] > 0:
                param.grad = _as_grad(param, values.clone())


def _as_grad(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


def plan_buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Split ``params`` (in the order gradients are expected: backward runs roughly in reverse registration order)
    into buckets of one dtype and device each, closed once they hold ``cap_bytes`` or more of local gradient.

    A parameter larger than the cap gets a bucket of its own. Pure: the same parameters give the same buckets on
    every rank, which is what keeps the ranks' collectives in the same order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap {cap_bytes} bytes must be positive; use e.g. {int(DEFAULT_BUCKET_MB * 2**20)}")
    open_: dict[tuple, list[nn.Parameter]] = {}
    sizes: dict[tuple, int] = {}
    closed: list[list[nn.Parameter]] = []
    for param in params:
        key = (param.dtype, param.device.type, param.device.index)
        open_.setdefault(key, []).append(param)
        sizes[key] = sizes.get(key, 0) + local_shape(param).numel() * param.element_size()
        if sizes[key] >= cap_bytes:
            closed.append(open_.pop(key))
            sizes[key] = 0
    closed.extend(open_.values())
    return [
        Bucket(params=tuple(group), dtype=group[0].dtype, numel=sum(local_shape(p).numel() for p in group))
        for group in closed
    ]


def all_reduce_in_buckets(buckets: Sequence[Bucket], group, *, divisor: int = 1) -> None:
    """Reduce every bucket now (blocking), summing over ``group`` and dividing by ``divisor``."""
    for bucket in buckets:
        flat = bucket.flatten()
        dist.all_reduce(flat, group=group)
        bucket.unflatten(flat, divisor)


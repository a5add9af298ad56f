"""Parallel styles for the classic model types (``classic.py``): GPT-2's ``Conv1D`` layers, attention modules
that keep head counts as attributes, and BLOOM's per-head ALiBi bias.

- ``Conv1DColwise`` / ``Conv1DRowwise``: torch's column- and row-parallel styles for ``transformers``' ``Conv1D``,
  whose weight is ``[in, out]`` (a transposed Linear): column-parallel splits the weight on dimension 1 and the
  bias with it, row-parallel splits the weight on dimension 0 and keeps the bias whole.
- ``Conv1DFusedSlice``: a fused ``[q | k | v]`` ``Conv1D`` (GPT-2 ``c_attn``) kept whole on every rank; each rank
  keeps the columns of its own heads of every part, so q, k and v of the same heads stay together. The weight
  gradient, partial per rank, is summed over the TP ranks (as for ``ReplicatedKVColwise``).
- ``RowwiseParallelWritableOutput``: a row-parallel Linear whose output the model adds to in place (Falcon's
  parallel attention: ``mlp_output += attention_output``); DTensor hands out a view autograd forbids writing to.
- ``LocalAttributes``: divides integer attributes of a module (``num_heads``, ``split_size``) by ``tp``, for
  forwards that reshape by them.
- ``LocalAlibi``: slices the ALiBi bias a BLOOM or MPT attention receives to this rank's heads: the slopes
  stay the global heads' own, so the result is exact.

Not for: choosing which style goes where (``classic.py``, ``plans.py``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from hf_dist.tensor_parallel.styles import ReplicatedWithGradReduce, WritableOutput


def _check_conv1d(module: nn.Module, style: str) -> None:
    from transformers.pytorch_utils import Conv1D

    if not isinstance(module, Conv1D):
        raise ValueError(f"{style} shards transformers' Conv1D only, got {type(module).__name__}")


def _distribute(module: nn.Module, device_mesh, placements: dict[int, list], src_data_rank) -> None:
    """Replace each parameter by a DTensor with the placements for its number of dimensions."""
    for name, param in module.named_parameters(recurse=False):
        dist_param = nn.Parameter(
            distribute_tensor(param.detach(), device_mesh, placements[param.ndim], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad,
        )
        module.register_parameter(name, dist_param)


def _apply_conv1d(style, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """torch's Colwise/RowwiseParallel ``_apply`` with the ``Conv1D`` partition (weight ``[in, out]``)."""
    _check_conv1d(module, type(style).__name__)
    return distribute_module(
        module,
        device_mesh,
        style._partition_conv1d_fn,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Conv1DColwise(ColwiseParallel):
    """Column-parallel ``Conv1D``: weight ``[in, out]`` split on ``out``, bias split with it."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {2: [Shard(1)], 1: [Shard(0)]}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _apply_conv1d(self, module, device_mesh)

    def __repr__(self) -> str:
        return "Conv1DColwise()"


class Conv1DRowwise(RowwiseParallel):
    """Row-parallel ``Conv1D``: weight ``[in, out]`` split on ``in`` (input sharded on features), bias whole."""

    def _partition_conv1d_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {2: [Shard(0)], 1: [Replicate()]}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _apply_conv1d(self, module, device_mesh)

    def __repr__(self) -> str:
        return "Conv1DRowwise()"


class Conv1DFusedSlice(ParallelStyle):
    """A fused ``Conv1D`` whose output is ``parts`` concatenated: whole weights, each rank's slice of every part."""

    def __init__(self, parts: tuple[int, ...]) -> None:
        super().__init__()
        self.parts = tuple(parts)

    def _partition_fn(self, name, module, device_mesh):
        ReplicatedWithGradReduce._partition_fn(self, name, module, device_mesh)

    @staticmethod
    def _prepare_input(module, inputs, device_mesh):
        hidden = inputs[0]
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, device_mesh, [Replicate()], run_check=False)
        return (hidden, *inputs[1:])

    def _prepare_output(self, module, output, device_mesh):
        # Only this rank's heads read its slice: the gradient arriving here is one rank's share of the whole.
        full = output.to_local(grad_placements=[Partial()])
        rank, tp = device_mesh.get_local_rank(), device_mesh.size()
        return torch.cat([part.chunk(tp, dim=-1)[rank] for part in full.split(list(self.parts), dim=-1)], dim=-1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv1d(module, "Conv1DFusedSlice")
        if sum(self.parts) != module.nf or any(p % device_mesh.size() for p in self.parts):
            raise ValueError(f"fused parts {self.parts} must sum to {module.nf} and divide by tp={device_mesh.size()}")
        return distribute_module(module, device_mesh, self._partition_fn, self._prepare_input, self._prepare_output)

    def __repr__(self) -> str:
        return f"Conv1DFusedSlice(parts={self.parts})"


class RowwiseParallelWritableOutput(WritableOutput, RowwiseParallel):
    """``RowwiseParallel`` whose local output the model may modify in place."""


class LocalAttributes(ParallelStyle):
    """Divide the named integer attributes of a module by ``tp`` (no parameters of its own)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for name in self.names:
            value = getattr(module, name)
            if not isinstance(value, int) or value % tp:
                raise ValueError(f"{type(module).__name__}.{name}={value!r} does not divide by tp={tp}")
            setattr(module, name, value // tp)
        return module

    def __repr__(self) -> str:
        return f"LocalAttributes({self.names})"


class LocalAlibi(ParallelStyle):
    """Slice an ALiBi keyword argument to this rank's ``heads / tp`` heads: BLOOM's ``alibi``
    (``[batch * heads, 1, keys]``, batch-major) or MPT's ``position_bias`` (``[heads, 1, keys]``)."""

    def __init__(self, heads: int, kwarg: str = "alibi") -> None:
        super().__init__()
        self.heads = heads
        self.kwarg = kwarg

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, tp, heads, kwarg = device_mesh.get_local_rank(), device_mesh.size(), self.heads, self.kwarg

        def slice_alibi(mod, args, kwargs):
            alibi = kwargs.get(kwarg)
            if alibi is not None:
                rows = alibi.view(-1, heads, *alibi.shape[1:]).chunk(tp, dim=1)[rank]
                kwargs[kwarg] = rows.reshape(-1, *alibi.shape[1:])
            return args, kwargs

        module.register_forward_pre_hook(slice_alibi, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"LocalAlibi(heads={self.heads}, kwarg={self.kwarg!r})"

"""Parallel styles that torch does not ship and HF decoder models need.

- ``FusedColwiseParallel``: a column-parallel Linear whose output is several projections concatenated
  (Phi-3 ``qkv_proj`` = [q | k | v], ``gate_up_proj`` = [gate | up]). Each part is split across the TP ranks
  on its own, so rank r holds ``[q_r | k_r | v_r]`` and the model's own slicing of the local output stays right.
- ``ReplicatedWithGradReduce``: parameters kept whole on every TP rank for a module that sees only this rank's
  heads (Qwen3 ``q_norm``/``k_norm``); the gradient, a partial sum per rank, is summed over the TP ranks.
- ``LocalHeadCounts``: rewrites the head counts an attention module reads from itself or its config so that
  slicing by ``config.num_attention_heads * head_dim`` addresses the local shard (Phi-3), or, with fewer KV
  heads than TP ranks, so that each local KV head serves all local query heads.
- ``ReplicatedKVColwise``: k/v projections when there are fewer KV heads than TP ranks (MQA, narrow GQA):
  the whole weight on every rank, each rank keeping the output of the one KV head its query heads use;
  the weight gradient, partial per rank, is summed over the TP ranks.

- ``HeadShardedNorm``: a norm holding one weight row per head (Cohere ``use_qk_norm``: weight ``[heads,
  head_dim]``), applied to this rank's heads: its weight is split by head like the projections before it.
- ``ColwiseParallelWritableOutput``: a column-parallel Linear whose local output the model modifies in place
  (OLMo ``clip_qkv`` clamps q/k/v with ``clamp_``); DTensor's ``to_local`` returns a view autograd forbids
  writing to, so this style hands the model a copy.

Not for: choosing which style goes where (``plans.py``) or validating sizes (``checks.py``).
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
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

FUSED_PARTS_ATTR = "_hf_dist_fused_parts"
"""Attribute set on a Linear sharded by ``FusedColwiseParallel``: ``(row count of each fused part, tp)``."""


def interleave_parts(weight: torch.Tensor, parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """Reorder rows ``[p0 | p1 | ...]`` into ``[p0_0 | p1_0 | ... | p0_1 | p1_1 | ...]`` (rank-major).

    After this, an even ``Shard(0)`` over ``tp`` ranks gives rank r the r-th slice of every part.
    """
    chunks = [part.chunk(tp, dim=0) for part in weight.split(list(parts), dim=0)]
    return torch.cat([chunk[r] for r in range(tp) for chunk in chunks], dim=0)


def deinterleave_parts(weight: torch.Tensor, parts: tuple[int, ...], tp: int) -> torch.Tensor:
    """Inverse of ``interleave_parts``: the HF row order back from the rank-major one."""
    local = [p // tp for p in parts]
    per_rank = [shard.split(local, dim=0) for shard in weight.chunk(tp, dim=0)]
    return torch.cat([per_rank[r][i] for i in range(len(parts)) for r in range(tp)], dim=0)


class FusedColwiseParallel(ColwiseParallel):
    """Column-parallel Linear over fused projections, each part sharded on its own.

    The global DTensor is the weight with rows reordered by ``interleave_parts``; ``FUSED_PARTS_ATTR`` on the
    module records ``(parts, tp)`` so that a gathered save can restore the HF order (``deinterleave_parts``).
    """

    def __init__(self, parts: tuple[int, ...], **kwargs) -> None:
        super().__init__(**kwargs)
        self.parts = tuple(parts)

    def _partition_linear_fn(self, name, module, device_mesh):
        tp = device_mesh.size()
        for param_name, param in module.named_parameters():
            reordered = interleave_parts(param.detach(), self.parts, tp)
            dist_param = nn.Parameter(
                distribute_tensor(reordered, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(param_name, dist_param)
        setattr(module, FUSED_PARTS_ATTR, (self.parts, tp))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedColwiseParallel shards nn.Linear only, got {type(module).__name__}")
        rows = module.weight.shape[0]
        if sum(self.parts) != rows:
            raise ValueError(f"fused parts {self.parts} sum to {sum(self.parts)}, but the Linear has {rows} rows")
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(parts={self.parts})"


class WritableOutput:
    """Mixin before a torch style (``ColwiseParallel``, ``RowwiseParallel``): its local output is a fresh tensor the
    model may modify in place, not a view DTensor's autograd still needs."""

    @classmethod
    def _prepare_output_fn(cls, output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = super()._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return outputs.clone() if use_local_output else outputs

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ColwiseParallelWritableOutput(WritableOutput, ColwiseParallel):
    """``ColwiseParallel`` whose local output the model may modify in place."""


def _reduce_partial_grad(param: torch.Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


class ReplicatedWithGradReduce(ParallelStyle):
    """Whole parameters on every TP rank, for a module whose input is sharded on dimension ``input_dim``.

    The input becomes a DTensor sharded on ``input_dim`` so the weight gradient comes out as a partial sum;
    a post-accumulate hook sums it over the TP ranks (FSDP2, when it wraps the module, does the same itself).
    """

    def __init__(self, *, input_dim: int = -2) -> None:
        super().__init__()
        self.input_dim = input_dim

    def _partition_fn(self, name, module, device_mesh):
        for param_name, param in module.named_parameters(recurse=False):
            dist_param = nn.Parameter(
                distribute_tensor(param.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            if dist_param.requires_grad:  # a frozen one (a DPO/GRPO reference's) has no gradient to sum
                dist_param.register_post_accumulate_grad_hook(_reduce_partial_grad)
            module.register_parameter(param_name, dist_param)

    @staticmethod
    def _prepare_input(input_dim, module, inputs, device_mesh):
        hidden = inputs[0]
        dim = input_dim % hidden.ndim
        return (DTensor.from_local(hidden, device_mesh, [Shard(dim)], run_check=False), *inputs[1:])

    @staticmethod
    def _prepare_output(module, output, device_mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition_fn,
            partial(self._prepare_input, self.input_dim),
            self._prepare_output,
        )

    def __repr__(self) -> str:
        return f"ReplicatedWithGradReduce(input_dim={self.input_dim})"


class HeadShardedNorm(ParallelStyle):
    """A per-head norm (weight ``[heads, head_dim]``) on input ``[..., heads_local, head_dim]``: parameters split
    on their first dimension (heads), the input read as sharded on ``input_dim``; each rank owns its heads'
    rows whole, so their gradients need no reduction."""

    def __init__(self, *, input_dim: int = -2) -> None:
        super().__init__()
        self.input_dim = input_dim

    def _partition_fn(self, name, module, device_mesh):
        for param_name, param in module.named_parameters(recurse=False):
            dist_param = nn.Parameter(
                distribute_tensor(param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(param_name, dist_param)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition_fn,
            partial(ReplicatedWithGradReduce._prepare_input, self.input_dim),
            ReplicatedWithGradReduce._prepare_output,
        )

    def __repr__(self) -> str:
        return f"HeadShardedNorm(input_dim={self.input_dim})"


class CombinedStyle(ParallelStyle):
    """Several styles on one module, applied in order (e.g. sequence gathering and local head counts)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"CombinedStyle{self.styles!r}"


class _LocalConfigView:
    """Reads through to the model config, except for the attributes overridden for this TP shard."""

    def __init__(self, config, **overrides) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_config"), name)


class ReplicatedKVColwise(ParallelStyle):
    """k_proj / v_proj with ``kv_heads < tp`` (``tp % kv_heads == 0``): rank r keeps KV head ``r * kv // tp``."""

    def __init__(self, *, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    def _partition_fn(self, name, module, device_mesh):
        ReplicatedWithGradReduce._partition_fn(self, name, module, device_mesh)

    @staticmethod
    def _prepare_input(module, inputs, device_mesh):
        hidden = inputs[0]
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, device_mesh, [Replicate()], run_check=False)
        return (hidden, *inputs[1:])

    def _prepare_output(self, module, output, device_mesh):
        # Only this rank's query heads read its KV head: the gradient arriving here is one rank's share.
        full = output.to_local(grad_placements=[Partial()])
        head = device_mesh.get_local_rank() * self.kv_heads // device_mesh.size()
        return full[..., head * self.head_dim : (head + 1) * self.head_dim]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.size() % self.kv_heads != 0:
            raise ValueError(f"tp={device_mesh.size()} is not a multiple of num_key_value_heads={self.kv_heads}")
        return distribute_module(
            module,
            device_mesh,
            self._partition_fn,
            self._prepare_input,
            self._prepare_output,
        )

    def __repr__(self) -> str:
        return f"ReplicatedKVColwise(kv_heads={self.kv_heads}, head_dim={self.head_dim})"


class LocalHeadCounts(ParallelStyle):
    """Make an attention module see ``heads / tp`` query heads and its local KV heads (no parameters of its own).

    Local KV heads are ``kv_heads / tp``, or 1 when ``kv_heads < tp`` (each rank keeps one replicated KV head).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        config = module.config
        heads = config.num_attention_heads // tp
        kv_heads = max(config.num_key_value_heads // tp, 1)
        module.config = _LocalConfigView(config, num_attention_heads=heads, num_key_value_heads=kv_heads)
        if hasattr(module, "num_key_value_heads"):
            module.num_key_value_heads = kv_heads
        if hasattr(module, "num_heads"):
            module.num_heads = heads
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = heads // kv_heads
        return module

    def __repr__(self) -> str:
        return "LocalHeadCounts()"

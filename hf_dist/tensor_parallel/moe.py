"""Routed MoE experts under tensor parallelism: every expert split along its intermediate dimension.

transformers' plans name the experts module ``moe_tp_experts`` with ``packed_colwise`` on ``gate_up_proj`` and
``rowwise`` on ``down_proj`` (``transformers/distributed/tensor_parallel.py``): every rank holds a slice of every
expert's intermediate features, runs the model's own experts forward on its local slices, and one all-reduce sums
the partial expert outputs. ``ExpertsTensorParallel`` does the same with torch DTensors, reading the layout from
the experts module transformers' ``use_experts_implementation`` builds (``is_concatenated``, ``is_transposed``,
``has_bias``):

- ``gate_up_proj`` (``[E, 2I, H]``, or ``[E, H, 2I]`` transposed): gate and up are fused. Concatenated
  (``[gate | up]``: Qwen3-MoE, Mixtral, DeepSeek-V3) it is stored as ``_StridedShard(split_factor=2)`` so rank r
  holds ``[gate_r | up_r]`` while the global tensor (saves, ``full_tensor``) keeps the HF order (sharded
  checkpoints write the two blocks as two chunks of it: ``hf_dist/checkpoint/blocks.py``); interleaved
  (gate at even, up at odd features: gpt-oss) an even contiguous split already keeps each gate/up pair together.
  Its bias (gpt-oss) is split the same way.
- ``down_proj`` (``[E, H, I]``, or ``[E, I, H]`` transposed): split on the intermediate dimension (row-parallel).
  Its bias (gpt-oss ``down_proj_bias``) is whole on every rank and added by TP rank 0 only, so the summed output
  holds it once; its gradient (on rank 0 only) is summed over the TP ranks.
- the experts' input (hidden states and routing weights, the same on every rank) gets its gradient summed over the
  TP ranks in backward; the output is summed in forward. The router stays whole and needs no reduction: every
  gradient reaching it is already whole.

gpt-oss: transformers 5.23 ships no ``base_model_tp_plan`` for it, and 5.24 one with only the embedding (its
attention has sinks, one logit per head that no Linear holds). Its registry record carries hf_dist's plan for it
(``Family.tp_base_plan``, chosen by ``Family.tp_plan``), in transformers' style names: attention split by head like
the other families, the sinks split by head with it (``local_sinks``: read as this rank's heads during the
attention forward), the experts as above.

The model's own forward runs unchanged: during it the parameter attributes are this rank's local tensors (the
pattern of ``hybrid_styles.LocalParams``). Not for: which models may use this (``support.py``), the plan
(``plans.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from hf_dist.tensor_parallel.styles import _reduce_partial_grad


MOE_STYLES: frozenset[str] = frozenset({"local_sinks"})
"""hf_dist's own style names used by the registry's ``tp_base_plan`` (built in ``plans.STYLE_BUILDERS``)."""


def own_plan(config) -> dict[str, str]:
    """hf_dist's ``base_model_tp_plan`` for ``config``'s MoE type (its registry record's ``tp_base_plan``) where the
    record chooses it; empty for other types."""
    from hf_dist.families import family_of

    record = family_of(config)
    return dict(record.tp_base_plan or {}) if record.tp_plan == "hf_dist" else {}


class _SumBackward(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` in backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumForward(torch.autograd.Function):
    """The tensor summed over ``group`` in forward; identity backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def expert_tp_layout(module: nn.Module) -> dict[str, tuple]:
    """``{parameter: (placement, whole_on_rank0_only)}`` for an experts module built by transformers'
    ``use_experts_implementation``; ``ValueError`` for one it did not build."""
    flags = ("is_concatenated", "is_transposed", "has_bias")
    if any(not hasattr(module, flag) for flag in flags) or not hasattr(module, "gate_up_proj"):
        raise ValueError(
            f"{type(module).__name__} is not an experts module built by transformers' use_experts_implementation "
            f"(gate_up_proj, down_proj and the flags {flags}); its experts cannot be tensor-parallel in hf_dist"
        )
    transposed = module.is_transposed
    fused_dim, down_dim = (2, 1) if transposed else (1, 2)
    gate_up = _StridedShard(fused_dim, split_factor=2) if module.is_concatenated else Shard(fused_dim)
    layout = {"gate_up_proj": (gate_up, False), "down_proj": (Shard(down_dim), False)}
    if module.has_bias:
        bias = _StridedShard(1, split_factor=2) if module.is_concatenated else Shard(1)
        layout.update({"gate_up_proj_bias": (bias, False), "down_proj_bias": (Replicate(), True)})
    return layout


class ExpertsTensorParallel(ParallelStyle):
    """Every routed expert split along its intermediate dimension over the TP ranks (module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank, group = device_mesh.size(), device_mesh.get_local_rank(), device_mesh.get_group()
        entries = []
        for name, (placement, rank0_only) in expert_tp_layout(module).items():
            param = module._parameters[name]
            per_rank = 2 * tp if name.startswith("gate_up") else tp  # gate/up: each part split on its own
            if not rank0_only and param.shape[placement.dim] % per_rank:
                raise ValueError(
                    f"{type(module).__name__}.{name} has {param.shape[placement.dim]} features on dimension "
                    f"{placement.dim}, which tp={tp} does not split evenly (per gate/up part); use a tp that divides "
                    f"the experts' intermediate size"
                )
            dist_param = nn.Parameter(
                distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            if rank0_only:
                dist_param.register_post_accumulate_grad_hook(_reduce_partial_grad)
            module.register_parameter(name, dist_param)
            entries.append((name, rank0_only))

        def swap_in(mod, args, kwargs):
            for name, rank0_only in entries:
                param = mod._parameters[name]
                if rank0_only:  # added once: by TP rank 0; the gradient is partial (rank 0's) until summed
                    local = param.to_local(grad_placements=[Partial()])
                    mod.__dict__[name] = local if rank == 0 else local * 0.0
                else:
                    mod.__dict__[name] = param.to_local()
            hidden, *rest = args
            hidden = _SumBackward.apply(hidden, group)
            if len(rest) >= 2:  # (router indices, routing weights, ...): the weights feed every rank's slice
                rest[1] = _SumBackward.apply(rest[1], group)
            elif "routing_weights" in kwargs or "top_k_weights" in kwargs:
                key = "routing_weights" if "routing_weights" in kwargs else "top_k_weights"
                kwargs = {**kwargs, key: _SumBackward.apply(kwargs[key], group)}
            return (hidden, *rest), kwargs

        def swap_out(mod, args, output):
            for name, _ in entries:
                mod.__dict__.pop(name, None)
            return _SumForward.apply(output, group) if isinstance(output, torch.Tensor) else output

        module.register_forward_pre_hook(swap_in, with_kwargs=True)
        module.register_forward_hook(swap_out, always_call=True)
        return module

    def __repr__(self) -> str:
        return "ExpertsTensorParallel()"

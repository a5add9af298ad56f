"""Tensor parallelism composed with data parallelism: FSDP2 on the dp axes, or plain replication.

TP shards over the innermost mesh axis; the data-parallel axes then either shard the (already TP-sharded)
parameters with FSDP2 ``fully_shard`` (2-D: each parameter is a DTensor over ``(dp, tp)``), or keep a full
TP shard on every dp rank and average gradients over dp (``replicate``, a per-parameter gradient hook:
DDP rejects a mix of Tensor and DTensor parameters).

``parallelize_causal_lm`` shows the order of application in one place: TP, activation checkpointing, FSDP.
Not for: the plans themselves (``plans.py``) or the Trainer glue (``hf_dist/trainer``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dist.tensor_parallel.apply import apply_tensor_parallel, unwrap_peft


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM (``model.model.layers``), also inside a ``PeftModel``."""
    base = unwrap_peft(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(base).__name__} has no decoder layer list at .model.layers")
    return layers


def fully_shard_tp_model(model: nn.Module, dp_mesh, *, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over ``dp_mesh`` on every decoder layer, then on the root; TP parameters become 2-D DTensors.

    The root reshards after forward too (FSDP2's default keeps it gathered): on torch 2.13 CPU, a first
    forward under ``no_grad`` with a gathered root made the following optimizer steps train wrong values.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def replicate_tp_model(model: nn.Module, dp_mesh) -> nn.Module:
    """Plain data parallelism over ``dp_mesh`` for a TP model: full TP shards everywhere, gradients averaged.

    Parameters are broadcast from dp rank 0 (as DDP does at construction); then every gradient is averaged
    over ``dp_mesh`` as soon as autograd has accumulated it. Averaging is linear, so with gradient
    accumulation the sum over micro-batches still ends up averaged (each micro-step pays one all-reduce).
    torch's FSDP2-based ``replicate`` was not used: on torch 2.13 CPU a forward under ``no_grad`` (an
    evaluation) followed by training segfaulted or trained nothing.
    """
    _broadcast_parameters(model, dp_mesh)
    group, size = dp_mesh.get_group(), dp_mesh.size()

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=group)
        local.div_(size)

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)
    return model


def _broadcast_parameters(model: nn.Module, dp_mesh) -> None:
    group = dp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if not local.is_meta:  # meta: filled later by the streaming load, the same on every rank
            dist.broadcast(local.data, src=src, group=group)


def parallelize_causal_lm(
    model: nn.Module,
    dims,
    *,
    data_parallel: Literal["fsdp", "replicate"] = "fsdp",
    plan: dict | None = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    activation_checkpointing: bool = False,
    mp_policy=None,
) -> nn.Module:
    """Apply TP, then activation checkpointing, then data parallelism, on ``dims``' mesh (built already).

    Args:
        model: a built HF causal LM (optionally a ``PeftModel``), identical on every rank.
        dims: ``hf_dist.ParallelDims`` with ``build_mesh`` called.
        data_parallel: ``"fsdp"`` shards parameters over the dp axis (FSDP2); ``"replicate"`` keeps them whole
            per TP shard and averages gradients. Ignored when ``dims.dp == 1``.
        plan, sequence_parallel, vocab_parallel: as in ``apply_tensor_parallel``.
    """
    if data_parallel not in ("fsdp", "replicate"):
        raise ValueError(f"data_parallel={data_parallel!r} must be 'fsdp' or 'replicate'")
    if dims.tp_enabled:
        apply_tensor_parallel(
            model, dims.get_mesh("tp"), plan=plan, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel
        )
    if activation_checkpointing:
        unwrap_peft(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dims.dp_enabled:
        if data_parallel == "fsdp":
            fully_shard_tp_model(model, dims.get_mesh("dp"), mp_policy=mp_policy)
        else:
            replicate_tp_model(model, dims.get_mesh("dp"))
    return model

"""Apply a tensor-parallel plan to an already-built HF causal LM, in place, on a 1-D ``tp`` mesh.

``apply_tensor_parallel`` checks support and sizes, translates the model's own plan (or takes the caller's),
expands it over PEFT LoRA layers, calls torch's ``parallelize_module`` on every module a pattern names, makes
the parameters that stay whole identical on every TP rank, and installs the vocab-parallel loss when the
lm_head is vocab-sharded.

Not for: data parallelism or FSDP (``hf_dist.parallelism``), saving (``hf_dist.state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from hf_dist.models.peft_utils import unwrap_peft
from hf_dist.tensor_parallel.checks import check_tp_sizes
from hf_dist.tensor_parallel.hybrid import layer_kind_patterns
from hf_dist.tensor_parallel.lora import expand_plan_for_lora, has_lora_layers
from hf_dist.tensor_parallel.loss import VocabParallelCausalLMLoss
from hf_dist.tensor_parallel.match import match_plan
from hf_dist.tensor_parallel.plans import (HEAD_PATTERNS, moe_dense_patterns, plan_names, resolve_styles,
                                          whole_experts)

TP_INFO_ATTR = "_hf_dist_tp"


@dataclass(kw_only=True, frozen=True)
class TensorParallelInfo:
    """What ``apply_tensor_parallel`` did to a model; stored on it as ``model._hf_dist_tp``."""

    tp: int
    """Tensor-parallel degree."""
    tp_mesh: object
    """The 1-D mesh the parameters are sharded on."""
    sequence_parallel: bool
    """Whether norms run on sequence shards."""
    vocab_parallel: bool
    """Whether embedding and lm_head are sharded on the vocabulary (logits come back vocab-sharded)."""
    plan: dict
    """The ``{pattern: ParallelStyle}`` plan that was applied."""


def _sync_whole_parameters(model: nn.Module, tp_mesh) -> None:
    """Broadcast every parameter that TP did not shard from TP rank 0, so all TP ranks start equal."""
    group = tp_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    for param in model.parameters():
        if not isinstance(param, DTensor) and not param.is_meta:  # meta: filled later, the same on every rank
            dist.broadcast(param.data, src=src, group=group)


def _to_placements(mesh, placements):
    def hook(grad):
        if isinstance(grad, DTensor) and grad.placements != placements:
            return grad.redistribute(mesh, placements)
        return grad

    return hook


def _keep_grads_sharded(model: nn.Module) -> None:
    """Make each DTensor parameter's gradient take the parameter's placements before it is accumulated.

    DTensor has no vocab-sharded rule for the embedding backward, so a vocab-parallel embedding's gradient comes
    back whole (``Replicate``) on every rank: a full vocab x hidden tensor kept until ``zero_grad``. FSDP2 does
    the same redistribution for the parameters it wraps (it replaces them, dropping these hooks).
    """
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_hook(_to_placements(param.device_mesh, param.placements))


def _retie_embeddings(model: nn.Module) -> None:
    output = model.get_output_embeddings()
    if output is not None and getattr(model.config, "tie_word_embeddings", False):
        output.weight = model.get_input_embeddings().weight


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh,
    *,
    plan: dict[str, ParallelStyle] | None = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    split_experts: bool = True,
) -> nn.Module:
    """Shard ``model`` (an HF ``*ForCausalLM``, optionally inside a ``PeftModel``) over ``tp_mesh`` in place.

    Args:
        model: the built model, on its device, every rank holding the same architecture.
        tp_mesh: a 1-D ``DeviceMesh`` (``ParallelDims.get_mesh("tp")``).
        plan: ``{module_pattern: ParallelStyle}``, patterns relative to the ``*ForCausalLM`` module, ``*`` for
            one path component. Default: the model's own plan with hf_dist's overlays (see ``plans.py``).
        sequence_parallel: run the norms on sequence shards (activations between layers are sequence-sharded).
        vocab_parallel: shard the embedding and lm_head on the vocabulary; the model then returns vocab-sharded
            logits and computes its loss with ``VocabParallelCausalLMLoss``.
        split_experts: split the routed experts along their intermediate dimension (``moe.py``); False keeps them
            whole on every TP rank, for expert parallelism to shard (``hf_dist.parallelize`` with ``ep > 1``).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (ParallelDims.get_mesh('tp')), got a {tp_mesh.ndim}-D mesh")
    target = unwrap_peft(model)
    config = target.config
    tp = tp_mesh.size()
    optional: frozenset[str] = frozenset()
    if plan is None:
        optional = HEAD_PATTERNS
        check_tp_sizes(config, tp, vocab_parallel=vocab_parallel)
        if tp == 1:
            return model
        names = plan_names(config, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel, tp=tp,
                           lora=has_lora_layers(target))
        optional = optional | layer_kind_patterns(config, names) | moe_dense_patterns(names)
        plan = resolve_styles(names if split_experts else whole_experts(names), config)
    elif sequence_parallel or vocab_parallel:
        raise ValueError(
            "sequence_parallel/vocab_parallel choose entries of hf_dist's family plans; with plan= given, "
            "put the sequence- or vocab-parallel styles in your plan and leave both flags False"
        )
    if tp == 1:
        return model
    plan = expand_plan_for_lora(target, plan, sequence_parallel=sequence_parallel)
    for name, style in match_plan(target, plan, optional=optional):
        module = target.get_submodule(name)
        if name in optional and not isinstance(module, nn.Linear):
            continue  # a pipeline stage's stand-in for a head another stage owns
        parallelize_module(module, tp_mesh, style)
    _sync_whole_parameters(target, tp_mesh)
    if vocab_parallel:
        _retie_embeddings(target)
        target.loss_function = VocabParallelCausalLMLoss(tp_mesh)
        _keep_grads_sharded(target)
    info = TensorParallelInfo(
        tp=tp, tp_mesh=tp_mesh, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel, plan=plan
    )
    setattr(target, TP_INFO_ATTR, info)
    return model


def tensor_parallel_info(model: nn.Module) -> TensorParallelInfo | None:
    """What ``apply_tensor_parallel`` recorded on ``model`` (``None`` for a model without TP)."""
    return getattr(unwrap_peft(model), TP_INFO_ATTR, None)


def whole_logits(model, logits):
    """Prediction logits with the whole vocabulary: vocab-sharded ones are gathered over the TP ranks.

    Only for ``Trainer.prediction_step``, whose caller needs whole predictions; the loss was already computed
    without them (``VocabParallelCausalLMLoss``).
    """
    info = tensor_parallel_info(model)
    if logits is None or info is None or not info.vocab_parallel or not isinstance(logits, torch.Tensor):
        return logits
    group = info.tp_mesh.get_group()
    parts = [torch.empty_like(logits) for _ in range(info.tp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)

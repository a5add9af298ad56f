"""Apply a run's layout to a model: ``apply_layout(model, dims, plan)``, outside the Trainer.

``ApplyPlan`` is the frozen list of what the layout needs beyond the mesh (``ParallelDims``): the device, mixed
precision, activation checkpointing, the FSDP2 request, TP's options, per-block compile, and for pipelines the
schedule, micro-batches and the launch canary. ``hf_dist.trainer.layout.apply_plan`` builds it once from the
training arguments; ``DistTrainer`` and ``hf_dist.from_pretrained`` then call ``apply_layout``, which chooses the
pipeline path (``hf_dist.pipeline_parallel.apply``) or ``hf_dist.parallelize``. Nothing here reads
``TrainingArguments``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_dist.compile import CompileRequest
from hf_dist.parallel_dims import ParallelDims


@dataclass(frozen=True, kw_only=True)
class ApplyPlan:
    """What applying a layout needs besides the mesh."""

    device: torch.device
    param_dtype: torch.dtype | None = None
    """bf16/fp16 compute (FSDP2's ``MixedPrecisionPolicy``; a pipeline needs the model loaded in it); None: fp32."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (also when the FSDP request asks for it)."""
    fsdp: object | None = None
    """The ``FsdpRequest`` (None: no FSDP2)."""
    sequence_parallel: bool = False
    vocab_parallel: bool = False
    compile_request: CompileRequest | None = None
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    layout_canary: bool = True
    """Under PP: check a tiny twin of the model against one process at launch."""
    chunked_loss: bool = True
    """Under PP: the last stage computes the loss chunk by chunk (``hf_dist.loss``)."""


def apply_layout(model: nn.Module, dims: ParallelDims, plan: ApplyPlan) -> nn.Module:
    """``model`` laid out for ``dims`` (its mesh built here): this rank's pipeline stages under PP, else
    ``hf_dist.parallelize``. A model on ``meta`` stays there (it is filled after the layout)."""
    from hf_dist.internals import check_internals
    from hf_dist.parallelism import parallelize
    from hf_dist.pipeline_parallel.apply import apply_pipeline

    check_internals()  # a private library member the layouts rely on that is gone: stop before any mesh
    dims.build_mesh(plan.device.type)
    if any(p.is_meta for p in model.parameters()):  # built on meta: move what already holds values (buffers, adapters)
        model._apply(lambda t: t if t.is_meta else t.to(plan.device))
    else:
        model = model.to(plan.device)
    if dims.pp_enabled:  # split into this rank's stages (TP/FSDP inside the stages)
        return apply_pipeline(dims, model, plan)
    model = parallelize(
        model,
        dims,
        fsdp=plan.fsdp,
        activation_checkpointing=plan.activation_checkpointing,
        param_dtype=plan.param_dtype,
        sequence_parallel=plan.sequence_parallel,
        vocab_parallel=plan.vocab_parallel,
        compile_request=plan.compile_request,
    )
    _mark_distribution_owned(model)
    return model


def _mark_distribution_owned(model: nn.Module) -> None:
    """Tell the Trainer that the model owns placement and gradient reduction (no DDP wrap, no re-sharding)."""
    from hf_dist.models.peft_utils import unwrap_peft

    unwrap_peft(model)._is_distributed_loading_by_transformers = True

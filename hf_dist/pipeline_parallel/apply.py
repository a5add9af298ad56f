"""Lay a causal LM out as this rank's pipeline stages, for the Trainer (``hf_dist.parallelize`` inside each stage).

``apply_pipeline`` is what ``hf_dist.apply.apply_layout`` calls when ``pp_size > 1``: activation
checkpointing, the dtype check, the layout canary, the split (``PipelinedCausalLM``) and the ``PipelineModel`` the
Trainer holds. Not for: choosing the layout (``hf_dist.strategy.Layout``) or the Trainer's hooks.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_dist.parallelism import apply_activation_checkpointing
from hf_dist.pipeline_parallel.model import PipelineModel
from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from hf_dist.pipeline_parallel.schedules import PipelineConfig
from hf_dist.pipeline_parallel.stage_module import causal_lm_of


def apply_pipeline(dims, model: nn.Module, plan) -> PipelineModel:
    """Split ``model`` into this rank's stages for ``dims`` (mesh built) and wrap it for the Trainer.

    ``plan`` is the run's ``hf_dist.apply.ApplyPlan``. Activation checkpointing is enabled per decoder layer before
    the split; FSDP's ``reshard_after_forward`` is honoured. Mixed precision: the pipeline does not autocast, so
    bf16/fp16 need the model loaded in that dtype (the Harbor 13B recipe does).
    """
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model)  # per decoder layer, before the layers are split out
    wanted = plan.param_dtype
    dtype = next(model.parameters()).dtype
    if wanted is not None and dtype != wanted:
        raise ValueError(
            f"{'bf16' if wanted == torch.bfloat16 else 'fp16'}=True with pp_size={dims.pp} but the model is {dtype}: "
            f"the pipeline does not autocast; load the model in {wanted} (from_pretrained(..., dtype={wanted})) or "
            f"drop bf16/fp16"
        )
    config = PipelineConfig(schedule=plan.pp_schedule, microbatches=plan.pp_microbatches)
    if plan.layout_canary:
        from hf_dist.pipeline_parallel.canary import check_pipeline_layout

        check_pipeline_layout(causal_lm_of(model).config, dims, config, device=plan.device)
    reshard = plan.fsdp.reshard_after_forward if plan.fsdp is not None else False
    pipe = PipelinedCausalLM(model, dims=dims, config=config, device=plan.device, reshard_after_forward=reshard,
                             compile_request=plan.compile_request, chunked_loss=plan.chunked_loss)
    wrapped = PipelineModel(pipe)
    # The Trainer must not wrap it (DDP) or move it: placement and gradient reduction are the pipeline's.
    wrapped.is_distributed_loading_by_transformers = True
    wrapped._is_distributed_loading_by_transformers = True
    return wrapped


def chunked_loss_wanted(requested: bool, layout) -> bool:
    """Whether the last stage may compute the chunked loss (the ``chunked_loss`` flag, ``hf_dist.loss.policy``)."""
    from hf_dist.loss.policy import layout_refusal

    return bool(requested) and (layout is None or layout_refusal(layout) is None)

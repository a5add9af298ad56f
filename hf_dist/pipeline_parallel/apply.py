"""Lay a causal LM out as this rank's pipeline stages, for the Trainer (``hf_dist.parallelize`` inside each stage).

``apply_pipeline`` is what ``hf_dist.trainer.trainer.apply_owned_layout`` calls when ``pp_size > 1``: activation
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


def apply_pipeline(dims, model: nn.Module, args) -> PipelineModel:
    """Split ``model`` into this rank's stages for ``dims`` (mesh built) and wrap it for the Trainer.

    Activation checkpointing (``gradient_checkpointing`` or the FSDP request's) is enabled per decoder layer
    before the split; FSDP's ``reshard_after_forward`` is honoured. Mixed precision: the pipeline does not
    autocast, so ``bf16``/``fp16`` need the model loaded in that dtype (the Harbor 13B recipe does).
    """
    fsdp = getattr(args, "hf_dist_fsdp", None)
    if args.gradient_checkpointing or (fsdp is not None and fsdp.activation_checkpointing):
        apply_activation_checkpointing(model)  # per decoder layer, before the layers are split out
    wanted = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    dtype = next(model.parameters()).dtype
    if wanted is not None and dtype != wanted:
        raise ValueError(
            f"bf16={args.bf16}, fp16={args.fp16} with pp_size={args.pp_size} but the model is {dtype}: the pipeline "
            f"does not autocast; load the model in {wanted} (from_pretrained(..., dtype={wanted})) or drop bf16/fp16"
        )
    config = PipelineConfig(schedule=args.pp_schedule, microbatches=args.pp_microbatches)
    if getattr(args, "layout_canary", True):
        from hf_dist.pipeline_parallel.canary import check_pipeline_layout

        check_pipeline_layout(causal_lm_of(model).config, dims, config, device=args.device)
    reshard = fsdp.reshard_after_forward if fsdp is not None else False
    from hf_dist.compile import CompileRequest

    pipe = PipelinedCausalLM(model, dims=dims, config=config, device=args.device, reshard_after_forward=reshard,
                             compile_request=CompileRequest.from_args(args), chunked_loss=chunked_loss_wanted(args))
    wrapped = PipelineModel(pipe)
    # The Trainer must not wrap it (DDP) or move it: placement and gradient reduction are the pipeline's.
    wrapped.is_distributed_loading_by_transformers = True
    wrapped._is_distributed_loading_by_transformers = True
    return wrapped


def chunked_loss_wanted(args) -> bool:
    """Whether the last stage may compute the chunked loss (``chunked_loss`` flag, ``hf_dist.loss.policy``)."""
    from hf_dist.loss.policy import layout_refusal

    layout = getattr(args, "layout", None)
    return bool(getattr(args, "chunked_loss", True)) and (layout is None or layout_refusal(layout) is None)

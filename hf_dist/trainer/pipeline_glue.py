"""Pipeline parallelism inside ``DistTrainer``: what each Trainer hook does when ``pp_size > 1``.

``DistTrainer`` calls one function from here per hook; the logic lives here, not in the Trainer.

Gradient accumulation becomes the pipeline's micro-batches. The batch contract derives accumulation ``a``
from the global batch; with PP one optimizer step is one pipeline step over the data-parallel rank's whole
share of the global batch (``per_device_train_batch_size x a`` sequences) cut into ``a`` micro-batches, so
the Trainer runs with ``gradient_accumulation_steps=1`` and a data-loader batch of ``micro x a``
(``fold_accumulation_into_pipeline``; ``per_device_train_batch_size`` keeps meaning the micro-batch).
``pp_microbatches`` states ``a`` directly when no global batch is given.

- ``apply_pipeline``: split the model into this rank's stages (after activation checkpointing; each stage then
  goes through ``hf_dist.parallelize``); the Trainer holds a ``PipelineModel`` (local parameters under HF names).
- ``training_step``: runs the schedule (forward + backward), returns the global-batch mean loss on every rank.
- ``clip_grad_norm``: the norm over all stages (pp group), dp/tp shards included.
- evaluation: ``PipelineModel.forward`` runs the stages forward only; loss on every rank (and the logits,
  broadcast over the pp group, when the Trainer has ``compute_metrics``/``preprocess_logits_for_metrics``).
- ``finish_init``: data loaders shard by the dp rank only (ranks of one pipeline read the same batch).
- ``save``: a normal HF directory (or one PEFT adapter) written by rank 0.

"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from hf_dist.parallelism import apply_activation_checkpointing
from hf_dist.pipeline_parallel.save import save_pretrained
from hf_dist.pipeline_parallel.model import PipelineModel
from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from hf_dist.pipeline_parallel.schedules import PipelineConfig
from hf_dist.pipeline_parallel.stage_module import causal_lm_of
from hf_dist.trainer.dp_data import dp_gather_for_metrics, shard_data_by_dp


def fold_accumulation_into_pipeline(args) -> None:
    """With ``pp_size > 1``: pipeline micro-batches = contract accumulation; Trainer accumulation = 1."""
    if args.pp_size <= 1:
        return
    m = args.pp_microbatches
    contract = args.batch_contract
    if m is not None and m != contract.gradient_accumulation_steps:
        if args.global_batch_size is None and contract.gradient_accumulation_steps == 1:
            args.gradient_accumulation_steps = m  # no global batch given: pp_microbatches defines it
            args.batch_contract = contract = args._resolve_contract()
        else:
            raise ValueError(
                f"pp_microbatches={m} contradicts the batch contract: global_batch_size={contract.global_batch_size} "
                f"= per_device_train_batch_size={contract.micro_batch_size} x dp={contract.dp} x "
                f"{contract.gradient_accumulation_steps} micro-batches; with pp_size > 1 the micro-batches are the "
                f"accumulation steps, so drop pp_microbatches or set global_batch_size="
                f"{contract.micro_batch_size * contract.dp * m}"
            )
    PipelineConfig(schedule=args.pp_schedule, microbatches=contract.gradient_accumulation_steps)  # validate early
    # Idempotent: re-creating the arguments from these values (to_dict, resume) resolves the same contract.
    # The data loader's batch (micro x micro-batches) is set on the Trainer in finish_init.
    args.pp_microbatches = contract.gradient_accumulation_steps
    args.gradient_accumulation_steps = 1


def apply_pipeline(dims, model: nn.Module, args) -> PipelineModel:
    """Split ``model`` into this rank's stages for ``dims`` (mesh built) and wrap it for the Trainer.

    Activation checkpointing (``gradient_checkpointing`` or the FSDP request's) is enabled per decoder layer
    before the split; FSDP's ``reshard_after_forward`` is honoured. Mixed precision: the pipeline does not
    autocast, so ``bf16``/``fp16`` need the model loaded in that dtype (the Harbor 13B recipe does).
    """
    fsdp = getattr(args, "hf_dist_fsdp", None)
    if args.gradient_checkpointing or (fsdp is not None and fsdp.activation_checkpointing):
        apply_activation_checkpointing(model)  # per decoder layer, before the layers are split out
    if fsdp is not None and fsdp.cpu_offload:
        raise ValueError("FSDP cpu_offload with pp_size > 1 is not supported; drop cpu offload or set pp_size=1")
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
    pipe = PipelinedCausalLM(model, dims=dims, config=config, device=args.device, reshard_after_forward=reshard)
    wrapped = PipelineModel(pipe)
    # The Trainer must not wrap it (DDP) or move it: placement and gradient reduction are the pipeline's.
    wrapped.is_distributed_loading_by_transformers = True
    wrapped._is_distributed_loading_by_transformers = True
    return wrapped


def training_step(trainer, model: PipelineModel, inputs) -> torch.Tensor:
    """One optimizer step's forward and backward through the schedule; the loss for logging on every rank."""
    model.train()
    inputs = trainer._prepare_inputs(inputs)
    with trainer.compute_loss_context_manager():
        loss = model.pipeline.train_step(inputs, microbatches=_microbatches_for(trainer, inputs))
    return loss.detach()


def _microbatches_for(trainer, inputs) -> int:
    """The configured count, or fewer micro-batches of the same size for an epoch's short last batch."""
    args = trainer.args
    micro, rows = args.per_device_train_batch_size, inputs["input_ids"].shape[0]
    if rows == micro * args.pp_microbatches or rows % micro != 0:
        return args.pp_microbatches  # a full batch, or one train_step refuses with the reason
    return rows // micro


def clip_grad_norm(trainer) -> torch.Tensor:
    return trainer.model.pipeline.clip_grad_norm_(trainer.args.max_grad_norm)


def finish_init(trainer) -> None:
    """After ``Trainer.__init__``: data sharded and eval results gathered by dp rank only; logits on every
    rank when metrics need them."""
    shard_data_by_dp(trainer)
    trainer._train_batch_size = trainer.args.per_device_train_batch_size * trainer.args.pp_microbatches
    gather = dp_gather_for_metrics(trainer)
    trainer.accelerator.gather_for_metrics = gather  # the Trainer re-reads it after every evaluation loop
    trainer.gather_function = functools.partial(gather, use_gather_object=trainer.args.eval_use_gather_object)
    trainer.model.logits_everywhere = (
        trainer.compute_metrics is not None or trainer.preprocess_logits_for_metrics is not None
    )


def save(trainer, output_dir: str | None) -> None:
    """``Trainer._save`` under PP: every rank joins the gather, rank 0 writes weights, tokenizer and args."""
    output_dir = output_dir or trainer.args.output_dir
    save_pretrained(trainer.model.pipeline, output_dir)
    if not trainer.args.should_save:
        return
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))

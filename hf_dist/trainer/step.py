"""DistTrainer's training step and gradient clipping where they differ from the Trainer's: under PP.

Under PP one optimizer step is one pipeline step: the schedule runs forward and backward over this rank's
micro-batches (``hf_dist.pipeline_parallel.microbatches``) and returns the global-batch mean loss on every rank;
the gradient norm spans every stage. Every other layout runs the Trainer's own step. Not for: the schedule itself
(``hf_dist.pipeline_parallel``).
"""

from __future__ import annotations

import torch

from hf_dist.pipeline_parallel.microbatches import microbatches_for_rows


def pipeline_training_step(trainer, model, inputs) -> torch.Tensor:
    """One optimizer step's forward and backward through the schedule; the loss for logging on every rank."""
    model.train()
    inputs = trainer._prepare_inputs(inputs)
    with trainer.compute_loss_context_manager():
        loss = trainer.pipeline_step(model.pipeline, inputs)
    return loss.detach()


def token_loss_step(trainer, pipeline, inputs) -> torch.Tensor:
    """The causal-LM token loss through the schedule (``DistTrainer.pipeline_step``'s default)."""
    microbatches = microbatches_for_rows(trainer.args, inputs["input_ids"].shape[0])
    return pipeline.train_step(inputs, microbatches=microbatches)


def pipeline_clip_grad_norm(trainer) -> torch.Tensor:
    """The gradient norm over every stage's rank (dp/tp shards included), clipped to ``max_grad_norm``."""
    return trainer.model.pipeline.clip_grad_norm_(trainer.args.max_grad_norm)

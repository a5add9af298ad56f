"""When ``DistTrainer`` computes the training loss chunk by chunk (``hf_dist.loss``) instead of the model's own.

The chunked loss equals the model's, so it is used wherever it is exact and the Trainer would call the model's own
loss: training (not evaluation: metrics need whole logits), labels in the batch, no label smoother or
``compute_loss_func``, and a layout whose head is whole on this rank -- one process, DDP, FSDP2 (a head in the root is
gathered in the root's forward, a head unit around the loss: its registered forward). Under PP the last stage computes it (``hf_dist.pipeline_parallel.apply``), not this
module. Not under TP (the vocab-parallel loss, ``hf_dist.tensor_parallel.loss``), DeepSpeed (ZeRO-3 gathers the head only inside its own forward) or a whole-model
``torch.compile`` wrapper. Why a model is refused is logged once.
"""

from __future__ import annotations

import logging

from torch import nn

from hf_dist.loss.causal_lm import ChunkedCausalLMLoss
from hf_dist.loss.policy import layout_refusal

logger = logging.getLogger(__name__)


def trainer_refusal(trainer) -> str | None:
    """Why this run's layout keeps the model's own loss (None: the chunked loss may be used)."""
    if not trainer.args.chunked_loss:
        return "chunked_loss=False"
    if trainer.is_deepspeed_enabled:  # also a DeepSpeed config given other than through the layout
        return "DeepSpeed gathers the head only inside its own forward"
    refusal = layout_refusal(trainer.args.layout)
    if refusal is not None:
        return refusal
    if trainer.label_smoother is not None or trainer.compute_loss_func is not None:
        return "a label smoother or compute_loss_func needs the whole logits"
    return None


def chunked_loss_for(trainer, model: nn.Module, inputs: dict) -> ChunkedCausalLMLoss | None:
    """The chunked loss to call instead of ``model`` for this batch, or None for the model's own forward."""
    if not model.training or "labels" not in inputs or trainer_refusal(trainer) is not None:
        return None
    if inputs.get("return_dict") is False:  # the caller wants the model's tuple; the chunked loss returns a ModelOutput
        return None
    if type(model).__name__ == "OptimizedModule":  # accelerate's whole-model compile: hooks inside would be traced
        return None
    cached = getattr(trainer, "_chunked_loss", None)
    if cached is None or cached.model is not model:  # a new model (model_init, DDP wrap in train())
        cached = ChunkedCausalLMLoss(model)
        trainer._chunked_loss = cached
        if cached.refusal is not None and trainer.args.should_log:
            logger.warning("chunked loss off, the model's own loss is used: %s", cached.refusal)
    return cached if cached.refusal is None else None


def count_shifted_labels(trainer) -> None:
    """Count a causal LM's loss tokens as its loss uses them: ``labels[..., 1:]``.

    The Trainer decides the count of ``num_items_in_batch`` from ``model.loss_type``; a model whose ``loss_type`` is
    None (GPT-2, BLOOM, OPT, ...) still uses ``ForCausalLMLoss`` (transformers' default), so the Trainer counts one
    token too many per row and the loss comes out smaller than the token mean. Under PP hf_dist's last stage counts
    the shifted labels, so without this a GPT-2 run trained differently by layout.
    """
    from transformers.loss.loss_utils import ForCausalLMLoss

    from hf_dist.models.peft_utils import unwrap_peft

    model = unwrap_peft(trainer.model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return
    if getattr(model, "loss_function", None) is ForCausalLMLoss:
        trainer._loss_shifts_labels = True


def local_token_count(trainer, count):
    """The Trainer's ``num_items_in_batch`` with ``average_tokens_across_devices=False``: this rank's own count.

    The Trainer divides the count by ``tp x cp`` in every case, which is right only for a count gathered over all
    ranks. Not gathered, a TP rank's count is already its (whole, replicated) batch's, so the division made every TP
    loss tp times too large. Under CP the count is taken before the split (the dp rank's whole sequence), so its
    division by cp stays: it is each cp rank's share. ``tests/test_loss_options.py`` checks both against one process.
    """
    if count is None or trainer.args.average_tokens_across_devices or trainer.dims.tp == 1:
        return count
    return count * trainer.dims.tp

"""A causal LM's training loss through its own forward, with the head's logits made chunk by chunk.

``ChunkedCausalLMLoss(model)`` is called like the model (``loss_fn(**inputs)``, labels included) and returns the
model's output with ``loss`` equal to what the model itself returns: ``ForCausalLMLoss`` (labels shifted,
``ignore_index`` -100, summed and divided by ``num_items_in_batch`` when given, else the token mean), plus
``router_aux_loss_coef * aux_loss`` for mixture-of-experts models that return one. What differs is memory: the
model runs its own forward with ``logits_to_keep=1`` (so the model builds logits for the last position only), a
forward hook on its base model takes the final hidden states (after the model's own norm), and
``linear_cross_entropy`` runs them through the head's weight chunk by chunk. The hook computes the loss inside the
model's forward, so under FSDP2 the root's parameters (a tied head) are the gathered ones; an untied head, an FSDP2
unit of its own, is gathered around the loss by its registered forward method (``chunked.head_cross_entropy``).

The model's scaling or soft-capping of its logits is read from its config (``LogitTransform``) and *verified* on
the first call: the model's own last-position logits must equal the transform applied to the head's output on the
captured hidden state. A model that does anything else between its base model and its head (a multiplier this
module does not know, an extra norm) fails that check; the loss then falls back to the model's own for good, with
one warning. ``chunked_loss_refusal`` names what rules a model out before any forward.

A pipeline's last stage (``hf_dist.pipeline_parallel.stage_module.CausalLMStage``) calls it on its view of the
model with ``num_items_in_batch=1``, so ``loss`` is the micro-batch's token sum, which the schedule's
``TokenWeightedLoss`` divides by the global batch's tokens.

Not for: when a Trainer uses it (``hf_dist.trainer.trainer.DistTrainer.compute_loss``), evaluation (the model's
own forward, whose logits metrics need) or vocab-parallel TP (its own loss).
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn

from hf_dist.loss.chunked import LogitTransform, head_cross_entropy
from hf_dist.models.peft_utils import unwrap_peft

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100


def causal_lm(model: nn.Module) -> nn.Module:
    """The HF ``*ForCausalLM`` inside ``model`` (a DDP wrapper or a ``PeftModel`` around it)."""
    while isinstance(getattr(model, "module", None), nn.Module):  # DistributedDataParallel
        model = model.module
    return unwrap_peft(model)


def logit_transform(lm: nn.Module) -> LogitTransform:
    """The scaling / soft-capping ``lm``'s forward applies to its head's output (from its config and attributes)."""
    config = getattr(lm, "config", None)
    scale = getattr(lm, "logit_scale", None)
    return LogitTransform(
        multiply=scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None,
        divide=getattr(config, "logits_scaling", None),
        softcap=getattr(config, "final_logit_softcapping", None),
    )


def chunked_loss_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be computed chunk by chunk (None when it can; the first call still verifies)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    lm = causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if _own_class(head) is not nn.Linear:
        return f"its output head is {type(head).__name__}, not a plain nn.Linear (LoRA on lm_head, a custom head)"
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        return f"{type(lm).__name__}.forward takes no logits_to_keep"
    if getattr(lm, "loss_function", None) is not ForCausalLMLoss:
        return f"{type(lm).__name__} computes its loss with {getattr(lm, 'loss_function', None)}, not ForCausalLMLoss"
    if getattr(lm, "base_model", lm) is lm:
        return f"{type(lm).__name__} has no base model separate from its head"
    return None


def _own_class(module) -> type:
    """``module``'s class, not the ``FSDP<name>`` subclass ``fully_shard`` swaps in for an FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position i predicts token i + 1; the last position predicts nothing (as ``ForCausalLMLoss``)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class ChunkedCausalLMLoss:
    """``model(**inputs)`` for training with the loss made chunk by chunk (see the module docstring)."""

    def __init__(self, model: nn.Module, *, chunk_tokens: int | None = None) -> None:
        self.model = model
        self.lm = causal_lm(model)
        self.chunk_tokens = chunk_tokens
        self.verified = False
        self.refusal: str | None = chunked_loss_refusal(model)
        # Read only from a model it may run on: one it refuses (no config, a custom head) gets its own forward.
        self.transform = logit_transform(self.lm) if self.refusal is None else None

    def __call__(self, **inputs):
        if self.refusal is not None:
            return self.model(**inputs)
        labels = inputs.pop("labels")
        num_items = inputs.pop("num_items_in_batch", None)
        shift_labels = inputs.pop("shift_labels", None)
        targets = shift_labels if shift_labels is not None else shifted_targets(labels)
        captured: dict[str, torch.Tensor] = {}

        def loss_inside_forward(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
            head = self.lm.get_output_embeddings()
            captured["sum"] = head_cross_entropy(
                head, hidden, targets, transform=self.transform, chunk_tokens=self.chunk_tokens
            )
            if not self.verified:  # what the model's own forward will make of the last position
                with torch.no_grad():
                    captured["last"] = self.transform(head(hidden[:, -1:]))

        handle = self.lm.base_model.register_forward_hook(loss_inside_forward)
        try:
            outputs = self.model(**inputs, logits_to_keep=1)
        finally:
            handle.remove()
        if not self.verified and not self._verify(outputs, captured):
            return self.model(**inputs, labels=labels, num_items_in_batch=num_items,
                              **({} if shift_labels is None else {"shift_labels": shift_labels}))
        total = captured["sum"]
        if num_items is not None:
            loss = total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)
        else:
            loss = total / (targets != IGNORE_INDEX).sum()
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None:  # MoE models add it only when labels are given, which the chunked forward does not pass
            loss = loss + self.lm.router_aux_loss_coef * aux.to(loss.device)
        outputs["loss"] = loss
        return outputs

    def _verify(self, outputs, captured) -> bool:
        """The model's own last-position logits against ours; on mismatch fall back for good (one warning)."""
        last = captured.get("last")
        if last is not None and (not torch.isfinite(last).all() or not last.any()):
            return True  # non-finite or zero logits prove nothing (a pipeline stage's shape inference on empty buffers)
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None and not isinstance(getattr(self.lm, "router_aux_loss_coef", None), (int, float)):
            self.refusal = f"{type(self.lm).__name__} returns an aux_loss but no router_aux_loss_coef weighs it"
        elif "last" not in captured or not torch.allclose(outputs.logits.float(), captured["last"].float(),
                                                          rtol=1e-5, atol=1e-6):
            self.refusal = (f"{type(self.lm).__name__}'s logits are not {self.transform} of its head's output on its "
                            f"base model's last hidden state")
        if self.refusal is not None:
            logger.warning("chunked loss off, the model's own loss is used: %s", self.refusal)
            return False
        self.verified = True
        return True

"""TRL's fused LM head under hf_dist's context parallelism: every cp rank gets the whole sequence's per-token figures.

Under CP each rank runs the decoder layers on its slice of every sequence (``hf_dist.context_parallel``), so the
backbone's last hidden states are a slice, while TRL's DPO sums each sequence's per-token log-probabilities over the
whole sequence (and logs token-level metrics over it). ``split_fused_lm_head`` wraps the forward TRL's
``add_fused_lm_head`` installed: inside a training step's split it scores only this rank's slice of the shifted labels
(TRL's head takes pre-shifted ``shift_labels`` as given), then gathers each per-token field over the cp ranks, so
TRL's own code after the forward computes on exactly what one process computes, on every cp rank.

Gradients: every cp rank computes the same loss from the gathered values; the gather's backward sums the cp ranks'
gradients (all identical) and keeps this rank's slice, i.e. ``cp`` times the slice's own gradient; hf_dist averages
gradients over the dp x cp ranks, so the sum of the slices' contributions, one process's gradient, is what is applied.
Outside a training step's split (evaluation, generation) the forward is TRL's, on the whole sequence.

Not here: the split itself (``hf_dist.context_parallel``), which layouts DPO runs (``hf_dist.trainer.trl_layout``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from hf_dist.context_parallel import context_parallel_state
from hf_dist.context_parallel.inputs import shift_labels

PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class _GatherSequence(torch.autograd.Function):
    """``[B, S/cp, ...]`` slices joined on dim 1 over ``group``; backward: the gradient summed over the group, this
    rank's slice kept."""

    @staticmethod
    def forward(ctx, local, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=1)[ctx.rank], None, None, None


def gather_sequence(local: torch.Tensor, state) -> torch.Tensor:
    """This rank's sequence slice joined with the other cp ranks' (differentiable for floating-point tensors)."""
    if local.is_floating_point():
        return _GatherSequence.apply(local, state.group, state.rank, state.size)
    widened = local.to(torch.int64)  # gloo gathers no bool
    parts = [torch.empty_like(widened) for _ in range(state.size)]
    dist.all_gather(parts, widened.contiguous(), group=state.group)
    return torch.cat(parts, dim=1).to(local.dtype)


def split_fused_lm_head(model: nn.Module, step_state, own_state) -> None:
    """Wrap ``model``'s fused forward (TRL's ``add_fused_lm_head``, already installed) so that while ``step_state``
    (the policy's context-parallel state, active inside a training step) is active, it runs on this rank's slice
    under ``own_state`` (the split of the model it belongs to) and returns whole-sequence per-token fields, as one
    process's forward does."""
    fused = model.forward

    @functools.wraps(fused)
    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not (fused_lm_head and step_state.active and labels is not None and kwargs.get("shift_labels") is None):
            return fused(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)
        # shifted on the whole sequence (the last position scores nothing), then this rank's slice
        local_targets = own_state.local(shift_labels(labels)).contiguous()
        with own_state.split():
            outputs = fused(*args, fused_lm_head=True, shift_labels=local_targets, **kwargs)
        for name in PER_TOKEN_FIELDS:
            value = getattr(outputs, name, None)
            if value is not None:  # one process's fields hold S - 1 positions: the shifted-away last one dropped
                setattr(outputs, name, gather_sequence(value, own_state)[:, :-1])
        return outputs

    model.forward = forward


def split_trl_heads(trainer) -> None:
    """Under CP: the policy's fused LM head, and a separate reference's, return whole-sequence fields in training
    steps (``split_fused_lm_head``). The reference is laid out first (its own context-parallel state)."""
    from hf_dist.models.peft_utils import unwrap_peft

    step_state = context_parallel_state(trainer.model)
    split_fused_lm_head(unwrap_peft(trainer.model), step_state, step_state)  # the module TRL patched
    if trainer.ref_model is not None:
        split_fused_lm_head(trainer.ref_model, step_state, context_parallel_state(trainer.ref_model))

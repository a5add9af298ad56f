"""Labels and loss weighting for context parallelism: what each rank's loss is, so gradients equal one process.

The model keeps its whole-sequence inputs (``input_ids``, ``position_ids``, ``attention_mask``: its masks and rotary
tables are built for the whole sequence, ``attention``); only the *targets* are split. Labels are shifted on the
whole sequence first (``shift_labels``: token ``t`` predicts label ``t + 1``, so the shift crosses the slice
boundaries correctly), then each rank keeps its slice, which lines up with its slice of the logits.
transformers' causal-LM loss takes ``shift_labels`` as given.

The loss weighting is one function, ``token_weighted_loss``: each rank's loss is the sum of its tokens' losses
divided by the tokens of the whole batch (every CP rank's, and every dp rank's), times ``dp x cp`` because the
gradients are averaged over the ``dp x cp`` ranks (FSDP2 over ``dp_shard_cp``, replication over ``dp_cp``). The sum
over ranks is then one process's token mean. A MoE router aux term is the micro-batch's (``router``: the
statistics pooled over the cp ranks) and is weighted once, not by ``dp x cp``: the pooling's all-reduce already sums
the cp ranks' gradients, and the average over dp gives one process's mean over micro-batches. The Trainer reaches the same weights by its own
``num_items_in_batch`` arithmetic once ``get_cp_size`` is the cp degree (it divides the gathered token count by
tp x cp and multiplies the loss by world / tp); ``tests/test_context_parallel.py`` checks both against one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hf_dist.context_parallel.attention import ContextParallelState
from hf_dist.models.peft_utils import unwrap_peft
from hf_dist.models.router import aux_loss_coef

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one on the whole sequence, the last position ignored (transformers' shift)."""
    return nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


_PAD_VALUES = {"input_ids": 0, "inputs_embeds": 0, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX,
               "attention_mask": 0, "token_type_ids": 0}
"""What ``pad_to_slices`` fills each (batch, sequence, ...) input with; ``position_ids`` and ``seq_idx`` continue."""
_CONTINUED = {"position_ids": 1, "seq_idx": 0}
"""Inputs whose padding continues each row's last value, by this step."""
_VARLEN = {"cu_seq_lens_q": "max_length_q", "cu_seq_lens_k": "max_length_k"}
"""TRL's padding-free boundaries (flash / varlen kernels) and the longest document they imply."""


def pad_to_slices(inputs: dict, size: int) -> tuple[dict, int]:
    """``inputs`` with each sequence padded at its end to a multiple of ``size`` (every cp rank holds an equal
    slice), and how many positions were added (0: ``inputs`` itself).

    The added positions change no figure of the real tokens: their labels are ignored, their ``attention_mask`` is 0,
    their ``position_ids`` continue each row (a packed row's last document grows: the causal mask keeps every real
    token from seeing them; TRL's padding-free ``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` grow with it), and
    the router aux loss leaves them out (``router.PooledRouterLoss`` reads the count from
    ``ContextParallelState.split(padding=)``). So a packed row of any length trains as one process trains it unpadded.
    A per-position input this function does not know is refused by name, before any forward."""
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if ids is None or ids.dim() < 2 or ids.shape[1] % size == 0:
        return inputs, 0
    rows, length = ids.shape[:2]
    extra = -length % size
    out = dict(inputs)
    for key, value in inputs.items():
        if key in _VARLEN:
            out[key] = torch.cat([value[:-1], value[-1:] + extra])
            if _VARLEN[key] in inputs:
                out[_VARLEN[key]] = int(out[key].diff().max())
            continue
        per_position = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, length)
        if key in _CONTINUED and per_position:
            steps = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype) * _CONTINUED[key]
            out[key] = torch.cat([value, value[:, -1:] + steps], dim=1)
        elif key in _PAD_VALUES and per_position and (key != "attention_mask" or value.dim() == 2):
            widths = [0, 0] * (value.dim() - 2) + [0, extra]  # the sequence dim (1) only
            out[key] = nn.functional.pad(value, widths, value=_PAD_VALUES[key])
        elif per_position or key in _PAD_VALUES or key in _CONTINUED:
            raise ValueError(f"input {key!r} of shape {tuple(value.shape)} under context parallelism, sequence length "
                             f"{length} not divisible by cp_size={size}: hf_dist pads {', '.join(_PAD_VALUES)}, "
                             f"{', '.join(_CONTINUED)} (batch, sequence, ...) and {', '.join(_VARLEN)}, not this; pad "
                             f"the batch to a multiple of {size} in the collator (pad_to_multiple_of)")
    return out, extra


def split_targets(inputs: dict, state: ContextParallelState) -> dict:
    """``inputs`` for one context-parallel rank: whole-sequence model inputs, this rank's slice of the shifted
    labels as ``shift_labels`` (``labels`` stays, the model computes a loss only when it is given)."""
    if "labels" not in inputs and "shift_labels" not in inputs:
        return dict(inputs)
    shifted = inputs["shift_labels"] if "shift_labels" in inputs else shift_labels(inputs["labels"])
    state.local(inputs["input_ids"])  # the sequence itself must split evenly (clear error otherwise)
    out = dict(inputs)
    out["shift_labels"] = state.local(shifted).contiguous()
    return out


def global_token_count(local_shift_labels: torch.Tensor, group=None) -> torch.Tensor:
    """Tokens that count in the loss, summed over ``group`` (the ``dp x cp`` ranks of one step)."""
    count = local_shift_labels.ne(IGNORE_INDEX).sum().to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def token_weighted_loss(model: nn.Module, inputs: dict, state: ContextParallelState, *, reduce_group,
                        reduce_size: int) -> torch.Tensor:
    """This rank's loss such that gradients averaged over ``reduce_size`` ranks (``reduce_group``: the dp x cp
    ranks) equal one process's token-mean gradient over the whole batch of every rank.

    ``inputs`` are the whole-sequence batch of this dp rank (with ``labels``); call inside ``state.split()``.
    """
    inputs = split_targets(inputs, state)
    count = global_token_count(inputs["shift_labels"], reduce_group)
    out = model(**inputs, num_items_in_batch=count, use_cache=False)
    aux = out.get("aux_loss")
    coef = aux_loss_coef(unwrap_peft(model)) if aux is not None else None
    if not coef:
        return out.loss * reduce_size
    # the micro-batch's aux (pooled over the cp ranks, ``router``) once: its all-reduce sums the cp ranks' gradients
    aux = coef * aux.to(out.loss.device)
    return (out.loss - aux) * reduce_size + aux

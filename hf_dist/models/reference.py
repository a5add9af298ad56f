"""The one-process reference of a training step: what a layout is compared with, by the before-launch layout
canary (``hf_dist.pipeline_parallel.canary``) and by the parity tests alike.

A step on a global batch run as micro-batches (the Trainer's micro-batches of every dp rank; under PP the
pipeline's micro-batches, which are the Trainer's) has the loss the Trainer and the pipeline give it::

    sum over micro-batches m of   (cross-entropy summed over m's label tokens) / (label tokens of the whole batch)
                                + router_aux_loss_coef x aux(m) / (number of micro-batches)

with ``aux(m)`` the model's own load-balancing loss of its forward on ``m`` (``router_aux_loss_scope=
"micro_batch"``, as the MoE models define it): ``hf_dist.trainer.router_loss`` weighs the Trainer's micro steps
so, ``pipeline_parallel.token_loss.TokenWeightedLoss`` the pipeline's. The language-model part is the whole
batch's token mean whatever the split; the aux part is not (a product of two means over the tokens one forward
sees), so the reference splits as the run does: one forward over the whole batch is a different loss.

Not for: ``router_aux_loss_scope="global_batch"`` (router statistics pooled over the dp ranks before the aux,
``hf_dist.trainer.router_loss.global_batch_aux``), which pipeline parallelism refuses; optimizers and clipping
(the caller's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from hf_dist.models.router import adds_router_aux_loss

IGNORE_INDEX = -100


def split_rows(batch: Mapping[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` as ``count`` micro-batches of consecutive rows (rank-major: dp rank ``r``'s micro-batches are
    ``[r x count / dp, (r + 1) x count / dp)``, as the ranks slice the global batch)."""
    rows = next(iter(batch.values())).shape[0]
    if count < 1 or rows % count:
        raise ValueError(f"{rows} rows do not split into {count} equal micro-batches; use a divisor of {rows}")
    return [{k: v[i * (rows // count) : (i + 1) * (rows // count)] for k, v in batch.items()} for i in range(count)]


def reference_step(model: nn.Module, micro_batches: Sequence[Mapping[str, torch.Tensor]], *, aux: bool = True) -> float:
    """Forward and backward of every micro-batch in one process (gradients accumulate into ``.grad``); returns the
    step's loss as defined in the module docstring. ``aux=False``: the same step without the router aux term.

    Every micro-batch holds ``input_ids`` and ``labels`` (``-100`` where no loss), optionally ``attention_mask``.
    """
    config = model.config
    with_aux = aux and adds_router_aux_loss(model)
    tokens = max(sum(int((m["labels"][..., 1:] != IGNORE_INDEX).sum()) for m in micro_batches), 1)
    options = {"output_router_logits": with_aux} if hasattr(config, "output_router_logits") else {}
    total = 0.0
    for micro in micro_batches:
        inputs = {k: v for k, v in micro.items() if k != "labels"}
        out = model(**inputs, **options)
        loss = model.loss_function(out.logits, micro["labels"], config.vocab_size, num_items_in_batch=tokens)
        if with_aux:
            loss = loss + config.router_aux_loss_coef * out.aux_loss.to(loss.device) / len(micro_batches)
        loss.backward()
        total += float(loss.detach())
    return total

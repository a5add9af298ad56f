"""A pairwise preference loss through the pipeline: DPO's chosen and rejected rows scored on the last stage.

A preference batch holds ``P`` chosen rows then ``P`` rejected rows (TRL's concatenation), and the loss of a pair
needs both rows' summed log-probabilities under the policy and under a frozen reference. Here:

- ``pair_order`` reorders the rows so that each pipeline micro-batch holds whole pairs (its chosen rows, then the
  same pairs' rejected rows): micro-batch ``k`` is what one process's accumulation step ``k`` sees;
- ``SequenceHead`` is the last stage's head (``CausalLMStage.head``): the model's fused forward (called with
  ``fused_lm_head=True``; the caller installs it on the stage's view) scores the labels, and the head returns each
  row's summed log-probability and, detached, the sums behind the logged figures;
- ``SigmoidPairLoss`` is the schedule's loss: ``-log sigmoid(beta x (policy log-ratio - reference log-ratio))``
  summed over the micro-batch's pairs and divided by the global batch's pairs, so summing micro-batches and dp ranks
  gives one process's mean; the reference's per-row log-probabilities arrive as the schedule's target;
- ``pair_train_step`` runs one optimizer step's forward and backward (the reference first, forward only, one
  micro-batch at a time); ``pair_sums`` turns a micro-batch's figures into the sums the metrics are made from.

Not for: which trainer options this covers and the metric names (``hf_dist.trainer.dpo_pipeline``), the schedule
and the token loss (``pipeline``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM, pad_to_bucket
from hf_dist.pipeline_parallel.rng import pipeline_random_stream
from hf_dist.pipeline_parallel.schedules import check_microbatches
from hf_dist.loss.causal_lm import IGNORE_INDEX

ROW_FIGURES = ("tokens", "entropy", "mean_logits", "top1")
"""Per-row figures the head returns beside the log-probabilities: scored tokens, and the sums over them of the
next-token entropy, the mean logit and top-1 hits (0 where the fused forward does not compute a field)."""
PAIR_SUMS = ("pairs", "loss", "chosen_rewards", "rejected_rewards", "accurate", "margins", "chosen_logps",
             "rejected_logps", "entropy", "tokens", "chosen_logits", "chosen_tokens", "rejected_logits",
             "rejected_tokens", "chosen_top1")
"""What ``pair_sums`` sums over a micro-batch's pairs (columns of its result)."""


def pair_order(pairs: int, microbatches: int) -> torch.Tensor:
    """The row order that gives micro-batch ``k`` (the ``k``-th equal chunk of rows) pairs ``k x p .. k x p + p - 1``
    as ``[their chosen rows, their rejected rows]``, from a batch ``[P chosen, P rejected]`` (``p = P / m``)."""
    index = torch.arange(pairs).view(microbatches, pairs // microbatches)
    return torch.cat([index, index + pairs], dim=1).reshape(-1)


class SequenceHead:
    """A last stage's head: the fused forward of the stage's view scores ``labels``; returns ``(summed log-probability
    per row, ROW_FIGURES per row, detached)``."""

    def __call__(self, view, kwargs: Mapping, labels: torch.Tensor):
        out = view(**kwargs, labels=labels, fused_lm_head=True)
        log_probs = out.log_probs
        tokens = (labels[:, 1:] != IGNORE_INDEX).to(log_probs.dtype)
        fields = [tokens] + [torch.zeros_like(tokens) if getattr(out, name) is None else getattr(out, name).detach()
                             .to(log_probs.dtype) for name in ("entropy", "mean_logits", "is_top1")]
        return log_probs.sum(dim=1), torch.stack([f.sum(dim=1) for f in fields], dim=1).detach()


def install_sequence_head(pipe: PipelinedCausalLM, fuse: Callable) -> None:
    """A ``SequenceHead`` on ``pipe``'s last stage, after ``fuse(view)`` gave the stage's view of the model its fused
    forward (TRL's ``add_fused_lm_head``: the stage calls the view, not the model the trainer patched)."""
    for stage in pipe.modules:
        if stage.is_last:
            fuse(stage._lm)
            stage.head = SequenceHead()


def sigmoid_pair_losses(logps: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """Each pair's ``-log sigmoid(beta x ((chosen - ref chosen) - (rejected - ref rejected)))`` (rows: chosen half,
    then rejected half)."""
    chosen, rejected = (logps - reference).chunk(2)
    return -F.logsigmoid(beta * (chosen - rejected))


class SigmoidPairLoss:
    """The schedule's loss on the last stage: the micro-batch's pair losses summed, over ``denominator`` (the global
    batch's pairs). Every call's ``(log-probs, reference log-probs, figures)`` is appended to ``records``: torch's
    first step of a schedule also calls it once on placeholder tensors (shape inference), so a step reads the last
    ``microbatches`` records."""

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.denominator: torch.Tensor | float = 1.0
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        logps, figures = output
        self.records.append((logps.detach(), target, figures))
        return sigmoid_pair_losses(logps, target.to(logps.dtype), self.beta).sum() / self.denominator


def pair_sums(logps: torch.Tensor, reference: torch.Tensor, figures: torch.Tensor, beta: float) -> torch.Tensor:
    """``PAIR_SUMS`` over one micro-batch's pairs (float64): the pair loss, rewards ``beta x (logp - ref logp)``,
    reward accuracy and margin, log-probabilities, and the token figures of both halves."""
    logps, reference, figures = logps.double(), reference.double(), figures.double()
    chosen, rejected = logps.chunk(2)
    chosen_rewards, rejected_rewards = (beta * (logps - reference)).chunk(2)
    chosen_fig, rejected_fig = figures.chunk(2)
    col = {name: i for i, name in enumerate(ROW_FIGURES)}
    values = [
        float(chosen.numel()), sigmoid_pair_losses(logps, reference, beta).sum(), chosen_rewards.sum(),
        rejected_rewards.sum(), (chosen_rewards > rejected_rewards).double().sum(),
        (chosen_rewards - rejected_rewards).sum(), chosen.sum(), rejected.sum(), figures[:, col["entropy"]].sum(),
        figures[:, col["tokens"]].sum(), chosen_fig[:, col["mean_logits"]].sum(), chosen_fig[:, col["tokens"]].sum(),
        rejected_fig[:, col["mean_logits"]].sum(), rejected_fig[:, col["tokens"]].sum(),
        chosen_fig[:, col["top1"]].sum(),
    ]
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=logps.device) for v in values])


@torch.no_grad()
def sequence_logps(pipe: PipelinedCausalLM, batch: Mapping[str, torch.Tensor]) -> tuple | None:
    """``(log-probs, figures)`` per row of ``batch`` (with ``labels``) on the last stage's rank, None elsewhere: every
    stage forward in order, no schedule, no autograd (the last stage must have a ``SequenceHead``)."""
    return pipe._forward_stages(batch, batch["labels"])[0]


def pair_train_step(pipe: PipelinedCausalLM, batch: Mapping[str, torch.Tensor], *, loss: SigmoidPairLoss,
                    microbatches: int, reference: Callable[[dict], torch.Tensor | None]) -> tuple[torch.Tensor, list]:
    """One optimizer step over a preference batch (``input_ids``, ``attention_mask``, ``labels``: ``P`` chosen rows,
    then ``P`` rejected rows) in ``microbatches`` micro-batches of whole pairs; returns ``(the global-batch mean loss
    on every rank, the micro-batches' records on the last stage's rank, [] elsewhere)``.

    ``reference(micro-batch)`` returns the micro-batch rows' reference log-probabilities on the last stage's rank
    (every rank calls it: a forward through the pipeline). Gradients are accumulated into ``.grad`` and summed over
    dp, as ``PipelinedCausalLM.train_step`` does."""
    pairs = batch["input_ids"].shape[0] // 2
    check_microbatches(pairs, microbatches, pipe.plan.num_stages)
    order = pair_order(pairs, microbatches).to(batch["input_ids"].device)
    batch = {k: v[order].to(pipe.device) for k, v in pad_to_bucket(batch, pipe.config.pad_to_multiple_of).items()
             if v is not None}
    chunks = [{k: v.chunk(microbatches)[i] for k, v in batch.items()} for i in range(microbatches)]
    refs = [reference(chunk) for chunk in chunks]
    target = torch.cat(refs) if pipe.has_last else None
    pipe.stages, schedule = pipe._schedule_for(microbatches, batch["input_ids"].shape[1], loss)
    pipe.schedule = schedule
    loss.denominator = pipe._dp_sum(torch.tensor(float(pairs), device=pipe.device))
    loss.records.clear()
    kwargs = {**PipelinedCausalLM._model_kwargs(batch), "labels": batch["labels"]}
    losses: list[torch.Tensor] = []
    args = (batch["input_ids"],) if pipe.has_first else ()
    with pipeline_random_stream(pipe.pp_rank, pipe.device):
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    if pipe.tied_sync is not None:
        pipe.tied_sync.sync_grads(pipe.modules)
    pipe._allreduce_grads()
    local = torch.stack([l.detach() for l in losses]).sum() if pipe.has_last else torch.zeros(())
    records = loss.records[-microbatches:] if pipe.has_last else []
    loss.records.clear()
    return pipe._broadcast_loss(local.to(torch.float32)), records

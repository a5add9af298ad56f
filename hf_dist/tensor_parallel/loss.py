"""Causal-LM loss on vocab-sharded logits: no rank ever holds a full ``[tokens, vocab]`` logits tensor.

With ``vocab_parallel=True`` the lm_head is column-parallel and each TP rank gets logits for its slice of
the vocabulary. The cross entropy needs three numbers per token from the whole vocabulary (max, sum of
exponentials, the target's logit); each is reduced over the TP group as a ``[tokens]`` vector. The backward
pass is local: ``softmax - one_hot`` on this rank's slice.

``VocabParallelCausalLMLoss`` has the signature of transformers' ``ForCausalLMLoss`` and is installed as
``model.loss_function``, so ``model(input_ids, labels=...)`` and the Trainer get the right loss unchanged.
Not for: models whose lm_head is not vocab-sharded (they use transformers' loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of local logits ``[N, V/tp]`` against global targets ``[N]``."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, group):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        valid = target != ignore_index
        local_target = target - vocab_start
        in_shard = valid & (local_target >= 0) & (local_target < local_vocab)
        index = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * in_shard

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        reduced = torch.stack([target_logit, sum_exp])
        dist.all_reduce(reduced, group=group)
        target_logit, sum_exp = reduced[0], reduced[1]

        loss = (sum_exp.log() - target_logit) * valid
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, in_shard, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, in_shard, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -in_shard.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    group,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where ``target == ignore_index``) from this rank's ``[N, V/tp]`` logits."""
    return _VocabParallelCrossEntropy.apply(local_logits, target, vocab_start, ignore_index, group)


class VocabParallelCausalLMLoss:
    """Drop-in for transformers' ``ForCausalLMLoss`` when logits are sharded on the vocabulary dimension."""

    def __init__(self, tp_mesh) -> None:
        self.group = tp_mesh.get_group()
        self.tp_rank = tp_mesh.get_local_rank()

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        if shift_labels is None:
            labels = F.pad(labels.to(logits.device), (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        per_token = vocab_parallel_cross_entropy(
            logits.reshape(-1, local_vocab),
            target,
            vocab_start=self.tp_rank * local_vocab,
            group=self.group,
            ignore_index=ignore_index,
        )
        if num_items_in_batch is None:
            return per_token.sum() / (target != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(per_token.device)
        return per_token.sum() / num_items_in_batch

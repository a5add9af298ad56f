"""The pipeline's training loss on the last stage: token-weighted causal-LM cross entropy (plus a MoE's aux term).

Not here: the stages themselves (``stage_module``), DPO's pair loss (``pair_loss``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_dist.loss.causal_lm import IGNORE_INDEX
from hf_dist.models.router import aux_from_stats


def count_loss_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that contribute to the causal-LM loss: labels shifted left by one, ignoring ``-100``."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


class TokenWeightedLoss:
    """Causal-LM cross entropy summed over a micro-batch and divided by the step's total token count.

    The last stage's output is its logits, or (chunked loss) the micro-batch's summed cross-entropy already.

    Summing these over micro-batches (and data-parallel ranks) gives exactly the mean over every loss token of
    the global batch, as one process would compute it: micro-batches with more padding weigh less.
    ``denominator`` must be set before each step (``count_loss_tokens`` over the whole global batch).

    A MoE stage's output ``(logits, router statistics)`` adds ``aux_weight x`` the model's load-balancing loss of
    the micro-batch; ``aux_weight`` is ``router_aux_loss_coef / (micro-batches x dp)`` so the step weighs the aux
    ``coef x mean over the global batch's micro-batches``, as ``hf_dist.trainer.router_loss`` does without PP.
    Its gradient reaches every stage's routers through the statistics each stage passed on.
    """

    def __init__(self, experts: int = 0) -> None:
        self.denominator: float | torch.Tensor = 1.0
        self.experts = experts
        self.aux_weight = 0.0

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        aux = None
        if isinstance(output, tuple):
            output, stats = output
            aux = aux_from_stats(stats, self.experts)
        loss = self._token_loss(output, labels)
        return loss if aux is None else loss + self.aux_weight * aux.to(loss.device)

    def _token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 0:  # the last stage's chunked loss already summed the micro-batch's tokens
            return logits / self.denominator
        vocab = logits.shape[-1]
        total = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, vocab),
            labels[:, 1:].reshape(-1).to(logits.device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return total / self.denominator

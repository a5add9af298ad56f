"""Validation NLL and perplexity with the HF Trainer, offline, through the ``evaluate`` module hf_dist ships.

What it is for: pass ``preprocess_logits_for_metrics`` and ``compute_metrics`` to ``Trainer`` /
``DistTrainer``. The first reduces each batch's logits to two numbers per example (sum of token NLLs, number
of scored tokens), so the Trainer never accumulates full ``(examples, seq, vocab)`` logits; the second pools
them with ``hf_dist/metrics/perplexity/perplexity.py`` into a token-weighted ``nll`` and ``perplexity``
(logged as ``eval_nll`` / ``eval_perplexity``). Token-weighted means long and short examples count by their
tokens; the Trainer's own ``eval_loss`` is a mean of batch means and can differ from ``eval_nll``.

The token NLL uses the causal shift the models use in their loss: ``logits[:, :-1]`` scores
``labels[:, 1:]``; labels -100 are not scored.

What it is not: a generation-quality metric.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

IGNORE_INDEX = -100
PERPLEXITY_METRIC_PATH = Path(__file__).resolve().parent.parent / "metrics" / "perplexity" / "perplexity.py"


def token_nll(logits, labels):
    """Per example: ``(sum of token NLLs, scored-token count)``, both of shape ``(batch,)``, in float32.

    ``logits``: ``(batch, seq, vocab)``; ``labels``: ``(batch, seq)`` with -100 for unscored tokens.
    """
    import torch.nn.functional as F

    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match; "
            "expected logits (batch, seq, vocab) and labels (batch, seq)"
        )
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    counts = (shift_labels != IGNORE_INDEX).sum(dim=-1)
    return nll.sum(dim=-1), counts.float()


def lm_logits(outputs, labels):
    """The ``(batch, seq, vocab)`` logits among what the Trainer hands ``preprocess_logits_for_metrics``.

    The Trainer passes every model output but the loss, as a tuple when there are several. A mixture-of-experts
    model with ``output_router_logits=True`` puts its ``aux_loss`` (a scalar) first and its ``router_logits``
    (``(tokens, experts)`` per layer) after the logits, so the first element is not the logits: take the first
    tensor shaped ``(*labels.shape, vocab)``.
    """
    if not isinstance(outputs, (tuple, list)):
        return outputs
    for value in outputs:
        if hasattr(value, "dim") and value.dim() == 3 and tuple(value.shape[:2]) == tuple(labels.shape):
            return value
    shapes = [tuple(v.shape) if hasattr(v, "shape") else type(v).__name__ for v in outputs]
    raise ValueError(
        f"no model output has the shape (batch, seq, vocab) of logits for labels {tuple(labels.shape)} "
        f"(outputs: {shapes}); the model must return its logits (not only a loss) for evaluation"
    )


def preprocess_logits_for_metrics(logits, labels):
    """For ``Trainer(preprocess_logits_for_metrics=...)``: a ``(batch, 2)`` tensor ``[nll_sum, token_count]``."""
    import torch

    nll_sums, counts = token_nll(lm_logits(logits, labels), labels)
    return torch.stack([nll_sums, counts], dim=-1)


@lru_cache(maxsize=1)
def load_perplexity_metric():
    """The shipped ``evaluate`` perplexity module (loaded once per process, kept in memory: no cache files,
    so several ranks can load it at once)."""
    import evaluate

    return evaluate.load(str(PERPLEXITY_METRIC_PATH), keep_in_memory=True)


def compute_metrics(eval_pred) -> dict[str, float]:
    """For ``Trainer(compute_metrics=...)``: ``{"perplexity": ..., "nll": ...}``, weighted by tokens.

    Expects predictions from ``preprocess_logits_for_metrics`` (shape ``(examples, 2)``).
    """
    import numpy as np

    predictions = eval_pred.predictions
    if isinstance(predictions, (tuple, list)):
        predictions = predictions[0]
    predictions = np.asarray(predictions, dtype=np.float64)
    if predictions.ndim != 2 or predictions.shape[1] != 2:
        raise ValueError(
            f"predictions have shape {predictions.shape}, expected (examples, 2); pass "
            "preprocess_logits_for_metrics=hf_dist.data.preprocess_logits_for_metrics to the Trainer"
        )
    result = load_perplexity_metric().compute(
        nll_sums=predictions[:, 0].tolist(), token_counts=np.rint(predictions[:, 1]).astype(np.int64).tolist()
    )
    return {"perplexity": result["perplexity"], "nll": result["nll"]}

"""Token-weighted perplexity from per-example NLL sums, as an `evaluate` metric module shipped with hf_dist.

What it is for: hub metrics cannot be loaded offline, so hf_dist ships this file and loads it with
`evaluate.load("/abs/path/to/perplexity.py")` (see `hf_dist.data.evaluation`). It does not run a model:
the Trainer's `preprocess_logits_for_metrics` reduces each example to (sum of token NLLs, token count) and
this module pools them, so the result is weighted by tokens, not by examples or batches.

Each import sits on its own line: `evaluate` parses them to check dependencies.
"""

import math

import datasets
import evaluate
import numpy


_DESCRIPTION = """
Perplexity = exp(sum of token negative log-likelihoods / number of tokens), pooled over all examples.
"""

_KWARGS_DESCRIPTION = """
Args:
    nll_sums: per example, the sum of the natural-log NLL of its scored tokens.
    token_counts: per example, the number of scored tokens (labels != -100 after the causal shift).
Returns:
    perplexity: exp(nll).
    nll: sum(nll_sums) / sum(token_counts), the token-weighted mean NLL (nats per token).
    tokens: sum(token_counts).
"""


class Perplexity(evaluate.Metric):
    """Pools per-example NLL sums and token counts into token-weighted NLL and perplexity."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"nll_sums": datasets.Value("float64"), "token_counts": datasets.Value("int64")}
            ),
        )

    def _compute(self, nll_sums, token_counts):
        total_nll = float(numpy.sum(numpy.asarray(nll_sums, dtype=numpy.float64)))
        tokens = int(numpy.sum(numpy.asarray(token_counts, dtype=numpy.int64)))
        if tokens <= 0:
            raise ValueError(
                f"token_counts sum to {tokens}: no scored token, so perplexity is undefined; "
                "evaluate on examples with at least one label != -100"
            )
        nll = total_nll / tokens
        return {"perplexity": math.exp(nll), "nll": nll, "tokens": tokens}

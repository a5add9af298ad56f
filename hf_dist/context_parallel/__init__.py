"""Context parallelism: each sequence split over ``cp_size`` ranks, attention by all-to-all around the model's own
attention function (``attention``), targets and loss weighting (``inputs``), a MoE router aux loss from statistics
pooled over the cp ranks (``router``), which models run it (``support``).

Applied by ``hf_dist.parallelize`` (its only caller) when ``ParallelDims.cp > 1``; the Trainer glue (splitting
the targets in the training step) is ``hf_dist.trainer.context``.
"""

from hf_dist.context_parallel.attention import (
    ContextParallelState,
    all_to_all,
    apply_context_parallel,
    context_parallel_state,
)
from hf_dist.context_parallel.inputs import split_targets, token_weighted_loss
from hf_dist.context_parallel.support import CP_MODEL_TYPES, check_cp_support, cp_refusal

__all__ = [
    "CP_MODEL_TYPES",
    "ContextParallelState",
    "all_to_all",
    "apply_context_parallel",
    "check_cp_support",
    "context_parallel_state",
    "cp_refusal",
    "split_targets",
    "token_weighted_loss",
]

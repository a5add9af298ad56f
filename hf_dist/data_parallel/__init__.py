"""Data parallelism without FSDP: whole parameters (or TP shards) on every dp rank, gradients averaged in buckets.

``replicate(model, dp_mesh)`` is what ``hf_dist.parallelize`` applies when dp > 1 without FSDP (TP x DP);
``plan_buckets`` / ``all_reduce_in_buckets`` pack gradients for one collective per bucket (the pipeline's
once-per-step reduction uses them too). Not for: FSDP2 (``hf_dist.parallelism.apply_fsdp``), choosing the layout.
"""

from hf_dist.data_parallel.buckets import DEFAULT_BUCKET_MB, Bucket, all_reduce_in_buckets, plan_buckets
from hf_dist.data_parallel.reducer import GradientReducer, replicate

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "GradientReducer", "all_reduce_in_buckets", "plan_buckets", "replicate"]

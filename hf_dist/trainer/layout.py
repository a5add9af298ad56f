"""Which ``ParallelDims`` a DistTrainer run has, and telling the Trainer that hf_dist owns the model's placement.

Applying the layout is ``hf_dist.parallelize`` (``hf_dist.parallelism``); DDP (without TP/PP) and DeepSpeed are
left to accelerate, which does them correctly on CPU and GPU once ``use_cpu`` is right (``launch_env``).
Not here: checkpointing (``checkpoint_glue``).
"""

from __future__ import annotations

from torch import nn

from hf_dist.models.peft_utils import unwrap_peft
from hf_dist.parallel_dims import ParallelDims


def layout_dims(*, world_size: int, tp: int, pp: int, fsdp: bool, dp_replicate: int = 1) -> ParallelDims:
    """The ``ParallelDims`` of a DistTrainer run: data-parallel ranks shard under FSDP (HSDP: inside each of
    ``dp_replicate`` groups), replicate otherwise (``hf_dist.strategy.strategy_dims``, the one mapping)."""
    from hf_dist.strategy import strategy_dims

    strategy = ("fsdp_hybrid_shard" if dp_replicate > 1 else "fsdp_full_shard") if fsdp else "ddp"
    return strategy_dims(strategy, world_size=world_size, tp=tp, pp=pp, dp_replicate=dp_replicate)


def mark_distribution_owned(model: nn.Module) -> None:
    """Tell the Trainer that the model owns placement and gradient reduction (no DDP wrap, no re-sharding)."""
    target = unwrap_peft(model)
    target._is_distributed_loading_by_transformers = True

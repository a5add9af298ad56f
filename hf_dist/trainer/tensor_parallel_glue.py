"""What ``DistTrainer`` changes in the HF Trainer when ``tp_size > 1`` (called from one line each).

- data: the loaders shard by data-parallel rank, so the TP ranks of a group read the same batch;
- metrics: evaluation and prediction gather over data-parallel ranks only (TP ranks hold copies of the same
  outputs; gathering them all would repeat every prediction ``tp`` times);
- TP degree: the Trainer divides ``num_items_in_batch`` and the global batch by ``get_tp_size()``;
- vocab parallelism: prediction logits gathered to the whole vocabulary (the loss never needs them).

Loss scaling, gradient clipping (``Trainer._mixed_mesh_grad_norm`` spans plain and DTensor gradients) and
the optimizer need nothing here. Not for: applying TP to the model (``hf_dist.parallelize``) or gathering it (``hf_dist.state_dict``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from hf_dist.tensor_parallel.apply import tensor_parallel_info
from hf_dist.trainer.dp_data import dp_gather_for_metrics, shard_data_by_dp


def whole_logits(model, logits):
    """Prediction logits with the whole vocabulary: vocab-sharded ones are gathered over the TP ranks.

    Only for ``Trainer.prediction_step``, whose caller needs whole predictions; the loss was already computed
    without them (``VocabParallelCausalLMLoss``).
    """
    info = tensor_parallel_info(model)
    if logits is None or info is None or not info.vocab_parallel or not isinstance(logits, torch.Tensor):
        return logits
    group = info.tp_mesh.get_group()
    parts = [torch.empty_like(logits) for _ in range(info.tp)]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def prepare_trainer(trainer) -> None:
    """Data by dp rank, metrics over dp ranks; call once after ``Trainer.__init__``."""
    shard_data_by_dp(trainer)
    gather = dp_gather_for_metrics(trainer)
    trainer.accelerator.gather_for_metrics = gather  # the Trainer re-reads it after every evaluation loop
    trainer.gather_function = functools.partial(gather, use_gather_object=trainer.args.eval_use_gather_object)

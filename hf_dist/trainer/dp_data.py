"""Data and eval metrics by data-parallel rank, for layouts whose model-parallel ranks share a batch (TP, PP).

accelerate shards the data loaders and gathers eval results over every process. Under tensor or pipeline
parallelism the ranks of one model-parallel group must read the same batch and hold the same eval results,
so both are done over the dp group instead. Used by DistTrainer for TP and PP.
"""

from __future__ import annotations

import torch


def dp_gather_for_metrics(trainer):
    """``Accelerator.gather_for_metrics`` over the dp group only.

    Ranks of one pipeline hold the same eval results; gathering over the world would repeat them pp x tp
    times and break accelerate's trimming of the padded last batch, which counts dp ranks (the data loader is
    sharded by dp). This gathers each dp rank's results once and trims the same way accelerate does.
    """
    import torch.distributed as dist
    from accelerate.utils import recursively_apply

    dims, state = trainer.dims, trainer.accelerator.gradient_state
    group = dims.get_mesh("dp").get_group() if dims.dp_enabled else None

    def gather_tensor(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous() if t.ndim else t.reshape(1)
        parts = [torch.empty_like(t) for _ in range(dims.dp)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts)

    def gather_for_metrics(input_data, use_gather_object: bool = False):
        if group is None:
            data = input_data
        elif use_gather_object:
            parts = [None] * dims.dp
            dist.all_gather_object(parts, input_data, group=group)
            data = [x for part in parts for x in (part if isinstance(part, list) else [part])]
        else:
            data = recursively_apply(gather_tensor, input_data, error_on_other_type=True)
        if state.end_of_dataloader and state.remainder > 0:  # drop the samples padding added to the last batch
            cut = lambda t: t[: state.remainder]  # noqa: E731
            return cut(data) if use_gather_object else recursively_apply(cut, data)
        return data

    return gather_for_metrics


def shard_data_by_dp(trainer) -> None:
    """Make the Trainer's data loaders shard by the dp rank only (accelerate would shard by world rank)."""
    import torch.distributed as dist
    from accelerate.data_loader import prepare_data_loader

    accelerator, dims = trainer.accelerator, trainer.dims
    dp_rank = dims.dp_rank(dist.get_rank())

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        prepared = prepare_data_loader(
            data_loader,
            accelerator.device,
            num_processes=dims.dp,
            process_index=dp_rank,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare

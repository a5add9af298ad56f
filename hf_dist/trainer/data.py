"""Data and eval metrics by data-parallel rank: the train loader of every layout, eval sharding under TP and PP.

Training data (``train_dataloader``): on every layout, ``DistTrainer`` trains from
``hf_dist.checkpoint.sampler.DataParallelBatchSampler`` -- the resumable order, sharded by dp rank (the ranks of
one TP group or pipeline read the same batch) -- and accelerate only places the batches on the device. The
Trainer's own skipping of trained batches on resume then continues at the same global sample on any dp degree.
Datasets without a length, and the ``group_by_length`` / ``batch_rebalance`` strategies, keep the Trainer's path.

Evaluation: accelerate shards eval loaders and gathers eval results over every process; under TP or PP both are
done over the dp group instead, by ``use_dp_group``, which hands the data-parallel group to the Trainer for the
layouts whose ranks share a batch (TP, PP, CP).
"""

from __future__ import annotations

import functools

import torch


def dp_gather(dims):
    """``accelerate.utils.gather`` for one tensor over the dp group only (each dp rank's tensor once, in dp-rank
    order: the order of the data it holds); the tensor itself without data parallelism."""
    import torch.distributed as dist

    group = dims.get_mesh("dp").get_group() if dims.dp_enabled else None

    def gather_tensor(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous() if t.ndim else t.reshape(1)
        if group is None:
            return t
        parts = [torch.empty_like(t) for _ in range(dims.dp)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts)

    return gather_tensor


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
    gather_tensor = dp_gather(dims)

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


def _prepare(accelerator, data_loader, *, num_processes: int, process_index: int, device_placement=None,
             slice_fn_for_dispatch=None):
    """``accelerate.data_loader.prepare_data_loader`` with this accelerator's settings and the given sharding."""
    from accelerate.data_loader import prepare_data_loader

    prepared = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=num_processes,
        process_index=process_index,
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


def shard_data_by_dp(trainer) -> None:
    """Make the Trainer's other data loaders (eval, iterable) shard by the dp rank only, not by world rank."""
    import torch.distributed as dist

    accelerator, dims = trainer.accelerator, trainer.dims
    dp_rank = dims.dp_rank(dist.get_rank())

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        return _prepare(accelerator, data_loader, num_processes=dims.dp, process_index=dp_rank,
                        device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch)

    accelerator.prepare_data_loader = prepare


def use_dp_group(trainer) -> None:
    """After ``Trainer.__init__``, for layouts whose ranks share a batch (TP, PP, CP): eval loaders shard by the dp rank
    and eval results gather over dp only. Under PP the train loader's batch is micro x micro-batches."""
    shard_data_by_dp(trainer)
    if trainer.dims.pp_enabled:  # accumulation runs inside the pipeline: one loader batch per optimizer step
        trainer._train_batch_size = trainer.args.per_device_train_batch_size * trainer.args.pp_microbatches
    gather = dp_gather_for_metrics(trainer)
    trainer.accelerator.gather_for_metrics = gather  # the Trainer re-reads it after every evaluation loop
    trainer.gather_function = functools.partial(gather, use_gather_object=trainer.args.eval_use_gather_object)


def train_dataloader(trainer):
    """The train loader from ``DataParallelBatchSampler`` for ``trainer`` (None: use the Trainer's own path)."""
    import sys

    import torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset
    from transformers.trainer_utils import has_length, seed_worker

    from hf_dist.checkpoint.sampler import DataParallelBatchSampler

    args, dataset = trainer.args, trainer.train_dataset
    strategy = str(getattr(args, "train_sampling_strategy", "random")).lower()
    if dataset is None or isinstance(dataset, IterableDataset) or not has_length(dataset):
        return None
    if strategy not in ("random", "sequential"):
        return None
    collator = trainer.data_collator
    hf_datasets = sys.modules.get("datasets")  # a datasets.Dataset exists only once the package was imported
    if hf_datasets is not None and isinstance(dataset, hf_datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    rank = dist.get_rank() if dist.is_initialized() else 0
    # accelerate seeds the Trainer's sampler with data_seed, else torch's current initial seed (the last
    # manual_seed: set_seed(args.seed), or a model_init that seeds): the same here, so the order is the Trainer's
    seed = args.data_seed if args.data_seed is not None else torch.random.initial_seed()
    sampler = DataParallelBatchSampler(
        len(dataset), seed=seed,
        dp_rank=trainer.dims.dp_rank(rank), dp_size=trainer.dims.dp, micro_batch_size=trainer._train_batch_size,
        shuffle=strategy == "random", drop_last=args.dataloader_drop_last,
    )
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor, multiprocessing_context=args.dataloader_multiprocessing_context,
        worker_init_fn=functools.partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
        in_order=args.dataloader_in_order,
    )
    return _prepare(trainer.accelerator, loader, num_processes=1, process_index=0)  # already sharded: place only

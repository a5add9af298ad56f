"""A deterministic, resumable data order that survives a change of data-parallel degree.

The global order is a stream of epochs, each a permutation of ``range(num_samples)`` drawn from
``seed + epoch`` (or ``range(num_samples)`` itself, unshuffled). Training consumes it in rounds of ``micro_batch_size x dp`` samples (one micro step on every
data-parallel rank); in a round, dp rank ``r`` takes the ``r``-th slice of ``micro_batch_size``. The only state
is the global count of samples consumed, so a checkpoint taken after ``k`` optimizer steps resumes at sample
``k x global_batch_size`` on any dp degree whose rounds divide the global batch: no sample is repeated or
skipped across a reshard.

``DataParallelBatchSampler`` is the same order cut into epochs, as batches for one dp rank: what ``DistTrainer``
trains from on every layout (``hf_dist.trainer.data``). An epoch's last round, when short, is completed from
the start of that epoch, so every rank gets the same number of batches -- the order accelerate's sharding of the
Trainer's seeded sampler yields (so a ``DistTrainer`` run reads what a one-process ``Trainer`` reads). When the
round divides the dataset, the epochs concatenated are exactly ``ResumableSampler``'s stream.

Not here: tokenisation, padding or collation (a ``DataLoader`` does that with this sampler).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(num_samples: int, seed: int, epoch: int, *, shuffle: bool = True) -> torch.Tensor:
    """The permutation used in ``epoch`` (same in every process); ``shuffle=False``: ``range(num_samples)``."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


def global_slice(num_samples: int, seed: int, start: int, count: int) -> list[int]:
    """Sample ids at global positions ``[start, start + count)`` of the stream."""
    ids: list[int] = []
    position = start
    while len(ids) < count:
        epoch, offset = divmod(position, num_samples)
        take = min(count - len(ids), num_samples - offset)
        ids += epoch_order(num_samples, seed, epoch)[offset : offset + take].tolist()
        position += take
    return ids


def _check_sizes(num_samples: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
    for name, value in (("num_samples", num_samples), ("dp_size", dp_size), ("micro_batch_size", micro_batch_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be a positive integer")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


class ResumableSampler(Sampler[int]):
    """Yields this dp rank's sample ids from global position ``samples_consumed`` on, without end.

    Use with ``DataLoader(dataset, batch_size=micro_batch_size, sampler=...)``: each batch is one micro step.
    A ``DataLoader`` prefetches, so the sampler runs ahead of training: checkpoint the position the training
    loop counted (steps x global batch), not ``samples_consumed`` of a sampler being iterated.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        samples_consumed: int = 0,
    ) -> None:
        _check_sizes(num_samples, dp_rank, dp_size, micro_batch_size)
        round_size = micro_batch_size * dp_size
        if samples_consumed % round_size != 0:
            raise ValueError(
                f"samples_consumed={samples_consumed} is not a multiple of micro_batch_size={micro_batch_size} x "
                f"dp_size={dp_size} = {round_size}: the position falls inside a micro step; resume from a checkpoint "
                f"taken at an optimizer-step boundary, or pick a micro batch whose round divides the global batch"
            )
        self.num_samples, self.seed = num_samples, seed
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.samples_consumed = samples_consumed

    @property
    def round_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    def next_micro_batch(self) -> list[int]:
        """This rank's ids for the next round; advances the global position by one round."""
        start = self.samples_consumed + self.dp_rank * self.micro_batch_size
        ids = global_slice(self.num_samples, self.seed, start, self.micro_batch_size)
        self.samples_consumed += self.round_size
        return ids

    def __iter__(self) -> Iterator[int]:
        while True:
            yield from self.next_micro_batch()


class DataParallelBatchSampler(Sampler[list[int]]):
    """This dp rank's micro-batches of one epoch at a time (``set_epoch``); the Trainer's train batch sampler.

    Round ``r`` of epoch ``e`` covers epoch positions ``[r x micro x dp, (r + 1) x micro x dp)``; dp rank ``k``
    takes ``micro`` of them from ``k x micro`` on. Positions past the end wrap to the epoch's start so every rank
    gets full batches (with one dp rank the last batch is short instead; with ``drop_last`` an incomplete round is
    dropped). Skipping ``s`` batches thus skips ``s x micro x dp``
    positions on any dp degree: a resume lands on the same global sample.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        _check_sizes(num_samples, dp_rank, dp_size, micro_batch_size)
        if drop_last and num_samples < micro_batch_size * dp_size:
            raise ValueError(
                f"drop_last with num_samples={num_samples} < micro_batch_size={micro_batch_size} x dp_size={dp_size}: "
                f"every round would be dropped; use a smaller batch or dataloader_drop_last=False"
            )
        self.num_samples, self.seed, self.shuffle, self.drop_last = num_samples, seed, shuffle, drop_last
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # accelerate's ``DataLoaderShard.total_batch_size`` (read by user code, and by accelerate for the remainder of
    # the last batch) is ``batch_sampler.batch_size x batch_sampler.num_processes``: the batch across the dp ranks.
    @property
    def batch_size(self) -> int:
        return self.micro_batch_size

    @property
    def num_processes(self) -> int:
        return self.dp_size

    def __len__(self) -> int:
        rounds, rest = divmod(self.num_samples, self.micro_batch_size * self.dp_size)
        return rounds + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.num_samples, self.seed, self.epoch, shuffle=self.shuffle)
        round_size = self.micro_batch_size * self.dp_size
        for r in range(len(self)):
            start = r * round_size + self.dp_rank * self.micro_batch_size
            end = start + self.micro_batch_size
            if self.dp_size == 1:  # one reader: a short last batch, as a plain DataLoader (nothing to even out)
                end = min(end, self.num_samples)
            positions = torch.arange(start, end) % self.num_samples
            yield order[positions].tolist()

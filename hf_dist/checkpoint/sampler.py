"""A deterministic, resumable data order that survives a change of data-parallel degree.

The global order is a stream of epochs, each a permutation of ``range(num_samples)`` drawn from
``seed + epoch``. Training consumes it in rounds of ``micro_batch_size x dp`` samples (one micro step on every
data-parallel rank); in a round, dp rank ``r`` takes the ``r``-th slice of ``micro_batch_size``. The only state
is the global count of samples consumed, so a checkpoint taken after ``k`` optimizer steps resumes at sample
``k x global_batch_size`` on any dp degree whose rounds divide the global batch: no sample is repeated or
skipped across a reshard.

Not here: tokenisation, padding or collation (a ``DataLoader`` does that with this sampler).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation used in ``epoch`` (same in every process)."""
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
        for name, value in (("num_samples", num_samples), ("dp_size", dp_size), ("micro_batch_size", micro_batch_size)):
            if value < 1:
                raise ValueError(f"{name}={value} must be a positive integer")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
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

"""The one data-sharding order (``hf_dist.checkpoint.sampler``), pure: ``DataParallelBatchSampler`` -- what
DistTrainer trains from -- reads what accelerate's sharding of the Trainer's seeded sampler reads, its epochs
concatenate to ``ResumableSampler``'s stream, and a resume after ``k`` steps lands on the same global samples on
any dp degree. (That DistTrainer uses it: ``test_trainer_parity``, ``test_checkpoint_trainer``.)"""

from __future__ import annotations

import itertools

import pytest

from hf_dist.checkpoint.sampler import DataParallelBatchSampler, ResumableSampler


def _accelerate_order(n, seed, epoch, micro, dp, rank, shuffle):
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler, SequentialSampler

    if shuffle:
        sampler = SeedableRandomSampler(range(n), data_seed=seed)
        sampler.set_epoch(epoch)
    else:
        sampler = SequentialSampler(range(n))
    batches = BatchSampler(sampler, micro, False)
    if dp == 1:  # accelerate does not shard for one process: the plain DataLoader's batches, the last one short
        return list(batches)
    return list(BatchSamplerShard(batches, num_processes=dp, process_index=rank, even_batches=True))


@pytest.mark.parametrize("n,micro,dp", [(32, 2, 2), (10, 2, 4), (9, 2, 4), (7, 3, 2), (5, 1, 1), (9, 2, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_batches_as_accelerate_sharding_the_trainers_sampler(n, micro, dp, shuffle):
    for epoch, rank in itertools.product((0, 3), range(dp)):
        ours = DataParallelBatchSampler(n, seed=42, dp_rank=rank, dp_size=dp, micro_batch_size=micro, shuffle=shuffle)
        ours.set_epoch(epoch)
        assert list(ours) == _accelerate_order(n, 42, epoch, micro, dp, rank, shuffle), (epoch, rank)
        assert len(ours) == len(list(ours))


def test_epochs_concatenate_to_the_resumable_stream():
    n, micro, dp = 24, 2, 3
    for rank in range(dp):
        batches = DataParallelBatchSampler(n, seed=5, dp_rank=rank, dp_size=dp, micro_batch_size=micro)
        per_epoch = []
        for epoch in range(3):
            batches.set_epoch(epoch)
            per_epoch += list(batches)
        stream = ResumableSampler(n, seed=5, dp_rank=rank, dp_size=dp, micro_batch_size=micro)
        assert per_epoch == [stream.next_micro_batch() for _ in range(len(per_epoch))]


def _step_samples(n, global_batch, micro, dp, step) -> list[int]:
    """The ids optimizer step ``step`` trains on (all dp ranks), skipping batches as the Trainer does on resume."""
    accumulation = global_batch // (micro * dp)
    ids = []
    for rank in range(dp):
        batches = list(DataParallelBatchSampler(n, seed=1, dp_rank=rank, dp_size=dp, micro_batch_size=micro))
        ids += [i for b in batches[step * accumulation : (step + 1) * accumulation] for i in b]
    return sorted(ids)


@pytest.mark.parametrize("step", [0, 3, 7])
def test_a_resume_reads_the_same_global_samples_on_any_dp_degree(step):
    n, global_batch = 64, 8
    expected = _step_samples(n, global_batch, 8, 1, step)
    for micro, dp in ((4, 1), (2, 2), (1, 4), (1, 8), (2, 4)):
        assert _step_samples(n, global_batch, micro, dp, step) == expected, (micro, dp)
    assert len(set(expected)) == global_batch


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="dp_rank=2 must be in"):
        DataParallelBatchSampler(8, seed=0, dp_rank=2, dp_size=2, micro_batch_size=1)
    with pytest.raises(ValueError, match="every round would be dropped"):
        DataParallelBatchSampler(3, seed=0, dp_rank=0, dp_size=2, micro_batch_size=2, drop_last=True)

"""DistTrainer on 2 gloo ranks (DDP, FSDP2) against one process with the same global batch (fp32, CPU)."""

import tempfile

import pytest
import torch

from dist_utils import run_distributed
from parity import assert_parity
from trainer_harness import train_tiny

GLOBAL_BATCH = 8
STEPS = 5


def _reference(micro: int):
    with tempfile.TemporaryDirectory() as out:
        losses, params, _ = train_tiny(
            out, max_steps=STEPS, global_batch_size=GLOBAL_BATCH, per_device_train_batch_size=micro
        )
    return losses, params


def _rank_run(rank, world_size, layout):
    overrides = dict(global_batch_size=GLOBAL_BATCH, per_device_train_batch_size=2)
    if layout == "fsdp2":
        overrides.update(fsdp="full_shard", fsdp_config={"version": 2})
    if layout == "hsdp":  # as accelerate's launcher passes a HYBRID_SHARD parallelism_config
        import os

        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2")
    with tempfile.TemporaryDirectory() as out:
        losses, params, trainer = train_tiny(out, max_steps=STEPS, **overrides)
    from torch.distributed.tensor import DTensor

    sharded = [
        (p.to_local().numel(), p.numel()) for p in trainer.model.parameters() if isinstance(p, DTensor)
    ]
    return {
        "dims": (trainer.dims.dp_replicate, trainer.dims.dp_shard),
        "losses": losses,
        "params": params,
        "accumulation": trainer.args.gradient_accumulation_steps,
        "num_processes": trainer.accelerator.num_processes,
        "sharded": sharded,
        "n_params": len(list(trainer.model.parameters())),
    }


@pytest.fixture(scope="module")
def reference():
    return _reference(micro=4)


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_two_ranks_match_single_process(reference, layout):
    ref_losses, ref_params = reference
    results = run_distributed(_rank_run, 2, layout)
    for result in results:
        assert result["num_processes"] == 2  # real data parallelism, not two lone trainings
        assert result["accumulation"] == 2  # 8 = 2 x 2 x 2
        assert_parity({"losses": result["losses"], "state": result["params"]},
                      {"losses": ref_losses, "state": ref_params}, atol=1e-4, state_rtol=1e-4, what=layout)
    if layout == "fsdp2":
        # every parameter is a DTensor holding about half the elements: really sharded, not DDP
        for result in results:
            assert len(result["sharded"]) == result["n_params"]
            assert sum(local for local, _ in result["sharded"]) < 0.6 * sum(full for _, full in result["sharded"])


def test_micro_batch_layouts_give_the_same_losses(reference):
    """Global batch 8 as 1 rank x micro 4 x accumulation 2 and as 1 rank x micro 2 x accumulation 4."""
    ref_losses, _ = reference
    losses, _ = _reference(micro=2)
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)


def test_hybrid_shard_on_four_ranks(reference):
    """HSDP (2 replicas x 2 shards, micro 2, accumulation 1): same losses; each rank holds half of each tensor."""
    ref_losses, ref_params = reference
    results = run_distributed(_rank_run, 4, "hsdp")
    for result in results:
        assert result["dims"] == (2, 2) and result["accumulation"] == 1
        torch.testing.assert_close(result["losses"], ref_losses, atol=1e-4, rtol=0)
        assert sum(local for local, _ in result["sharded"]) < 0.6 * sum(full for _, full in result["sharded"])
    assert_parity({"losses": results[3]["losses"], "state": results[3]["params"]},
                  {"losses": ref_losses, "state": ref_params}, atol=1e-4, state_rtol=1e-4, what="hsdp")

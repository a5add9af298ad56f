"""EP x HSDP through ``DistTrainer``: 4 and 8 gloo ranks against one process.

HSDP (``fsdp2_dp_replicate=2``: 2 replica groups of 2 or 4 ranks): each replica group holds every expert, split over
its ``ep=2`` ranks (and, in groups of 4, sharded over the other 2), and the groups all-reduce the experts' gradients as they do the dense ones; the dense parameters are
sharded inside a group. Tiny Qwen3-MoE loaded from disk (router aux loss on at 0.1, top-k and a sliding window
shorter than the sequence from the parity harness), 3 AdamW steps with clipping active: losses, gradient norms and
every parameter (routers, experts, norms) equal one process within 1e-5, and each rank's expert tensors are the
shard the layout promises. A checkpoint saved at step 2 resumes exactly.

(EP with FSDP2's CPU offload is refused by ``Layout``: the offload needs a GPU to run at all, so no CPU test proves it.)
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from parity import assert_parity, tiny_config
from trainer_harness import VOCAB, as_loaded, train_tiny

CASE = "qwen3_moe"
STEPS, MAX_NORM = 3, 0.5
BATCH = dict(max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=16, max_grad_norm=MAX_NORM)
"""4 data-parallel ranks x micro-batch 2 x 2 accumulation steps (the all-reduce across replicas deferred to the last)."""
HSDP = dict(fsdp2=True, fsdp2_dp_replicate=2, ep_size=2)
SAVE_AT = 2


def _model():
    from hf_dist.models.tiny import build_tiny_model

    config = tiny_config(CASE, "ep")
    config.vocab_size, config.router_aux_loss_coef = VOCAB, 0.1
    return as_loaded(build_tiny_model(config, seed=0))


def _norms(trainer) -> list[float]:
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


def _expert_layout(trainer) -> set:
    """``(mesh dims, placements, local rows / all rows)`` of every experts ``gate_up_proj``."""
    return {(p.device_mesh.mesh_dim_names, tuple(map(str, p.placements)), p.to_local().shape[0] / p.shape[0])
            for n, p in trainer.model.named_parameters() if n.endswith("experts.gate_up_proj")}


def _four_ranks(rank, world, root):
    losses, params, trainer = train_tiny(f"{root}/hsdp", model=_model(), **BATCH, **HSDP, save_strategy="steps",
                                         save_steps=SAVE_AT)
    dims = (trainer.dims.dp_replicate, trainer.dims.dp_shard, trainer.dims.ep, trainer.dims.efsdp)
    out = {"run": (losses, _norms(trainer), params if rank == 0 else None, _expert_layout(trainer), dims)}
    losses, params, _ = train_tiny(f"{root}/resumed", model=_model(), **BATCH, **HSDP,
                                   resume=f"{root}/hsdp/checkpoint-{SAVE_AT}")
    out["resumed"] = (losses, params if rank == 0 else None)
    try:  # FSDP2's CPU offload on a machine without a GPU: a ValueError naming the fix, not torch's RuntimeError
        train_tiny(f"{root}/offload", max_steps=1, fsdp="full_shard offload", fsdp_config={"version": 2})
    except ValueError as error:
        out["offload"] = str(error)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_four_ranks, 4, str(tmp_path_factory.mktemp("ep_hsdp")), timeout_s=900)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    losses, params, trainer = train_tiny(str(tmp_path_factory.mktemp("ep_hsdp_one")), model=_model(), **BATCH)
    return {"losses": losses, "norms": _norms(trainer), "state": params}


def _eight_ranks(rank, world, root):
    losses, params, trainer = train_tiny(f"{root}/hsdp8", model=_model(), **BATCH, **HSDP)
    dims = (trainer.dims.dp_replicate, trainer.dims.dp_shard, trainer.dims.ep, trainer.dims.efsdp)
    return {"run": (losses, _norms(trainer), params if rank == 0 else None, _expert_layout(trainer), dims)}


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """2 replica groups of 4: each group's experts split over ep=2 and sharded over the other 2 (the reduce-scatter
    inside a group, then the all-reduce across)."""
    return run_distributed(_eight_ranks, 8, str(tmp_path_factory.mktemp("ep_hsdp8")), timeout_s=1200)


@pytest.mark.parametrize("world", [4, 8])
def test_ep_hsdp_equals_one_process(request, reference, world):
    runs = request.getfixturevalue("runs" if world == 4 else "eight")
    for rank, result in enumerate(runs):
        losses, norms, _, experts, dims = result["run"]
        assert dims == (2, world // 2, 2, world // 2), rank  # dp_replicate, dp_shard, ep, efsdp
        # every experts tensor: replicated over the replica groups, inside one split over ep (and sharded over the
        # rest): each rank holds 1 / (ep x shards) of the experts
        ((mesh, placements, share),) = experts
        assert mesh == ("efsdp_replicate", "efsdp_shard", "ep") and placements[0] == "R", experts
        assert share == 1 / world * 2, experts
        assert min(norms) > MAX_NORM, rank  # clipping active on every step
    losses, norms, params, *_ = runs[0]["run"]
    assert_parity({"losses": losses, "norms": norms, "state": params}, reference, config=tiny_config(CASE, "ep"),
                  what=f"{CASE} EP2 x HSDP 2x{world // 2}")


def test_a_checkpoint_resumes_exactly(runs):
    for result in runs:
        losses, params = result["resumed"]
        assert len(losses) == STEPS
        torch.testing.assert_close(losses[-1], result["run"][0][-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(runs[0]["resumed"][1], runs[0]["run"][2], atol=1e-6, rtol=0)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the offload runs where there is a GPU")
def test_cpu_offload_without_a_gpu_is_refused_by_name(runs):
    for result in runs:
        assert "fsdp2_cpu_offload=True" in result.get("offload", "") and "drop the offload" in result["offload"]

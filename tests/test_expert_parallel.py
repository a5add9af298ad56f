"""Expert parallelism (``ep_size=2``) on 2 and 4 gloo ranks against one process, per tiny MoE type.

One spawn runs every case: qwen3_moe, mixtral, gpt_oss (router aux loss on, coefficient ``AUX``) and deepseek_v3
(grouped routing, shared expert, first layer dense), each with non-default top-k / ``norm_topk_prob``, under
EP=2 x FSDP2 FULL_SHARD and EP=2 x replicated dp (DDP); the sweep (``ep_cases.SWEEP_CASES``: each its own
non-default router, shared experts, dense layers or mixers; aux loss on wherever the model has one) under EP=2 x FSDP2;
qwen3_moe also with activation checkpointing and with SHARD_GRAD_OP. A second spawn of 4 ranks runs qwen3_moe and
mixtral at ep=2 with expert-FSDP degree 2 (experts sharded, or their gradients summed, over 2 ranks). Every case:
3 AdamW steps with gradient clipping active (``MAX_NORM`` below every step's norm, so the norm over the dense and
expert meshes decides the update), run by the parity harness's ``layout_run``; losses, gradient norms, the first
step's gradients and every parameter compared (``assert_parity``: router and expert weights among them).

The reference is the parity harness's one process (``parity.reference_run``) running the same micro-batches per
step (each rank's slice of the global batch): the router aux term per micro-batch, as the models define it and as the
layout canary's reference weighs it.
"""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from ep_cases import AUX_CASES, CASES, SWEEP_CASES, moe_config, moe_model, token_batches
from parity import MOE_ADAMW, MOE_GLOBAL_BATCH, MOE_STEPS, assert_parity, layout_run, reference_run, split_rows

MAX_NORM = MOE_ADAMW.max_norm
LAYOUTS = ("fsdp", "ddp")
EXTRA = {"fsdp_recompute": {"activation_checkpointing": True}, "shard_grad_op": {"reshard_after_forward": False}}
"""qwen3_moe only: activation checkpointing (the dispatch recomputed in backward) and SHARD_GRAD_OP (experts kept
gathered between forward and backward) -> FsdpRequest fields."""


def _reference(name: str, batches: list[dict], world: int, aux: float | None = None) -> dict:
    model = moe_model(name) if aux is None else moe_model(name, aux=aux)
    return reference_run(model, [split_rows(batch, world) for batch in batches], MOE_ADAMW, grads=aux is None)


def _parallel(name: str, layout: str, batches: list[dict], rank: int, world: int, ep: int = 2) -> dict:
    """The harness's ``layout_run`` on this rank of EP=``ep`` x FSDP2 (or x replicated dp) over ``world`` ranks, with
    how many experts of each MoE layer the rank holds."""
    from hf_dist import FsdpRequest, ParallelDims, parallelize
    from hf_dist.expert_parallel import expert_modules

    fsdp = layout != "ddp"
    dims = ParallelDims(world_size=world, dp_shard=world if fsdp else 1, dp_replicate=1 if fsdp else world, ep=ep)
    dims.build_mesh("cpu")
    model = parallelize(moe_model(name), dims, fsdp=FsdpRequest(**EXTRA.get(layout, {})) if fsdp else None)
    local_experts = {m.num_experts for m in expert_modules(model)}
    run = layout_run(model, batches, MOE_ADAMW, dp_rank=dims.dp_rank(rank), dp=dims.dp,
                     dp_group=dims.get_mesh("dp").get_group(), grads=True)
    return {**run, "local_experts": local_experts}


def _two_ranks(rank, world):
    batches = token_batches(MOE_STEPS, MOE_GLOBAL_BATCH)
    results = {}
    for name in CASES + SWEEP_CASES:
        results[name] = {"ref": _reference(name, batches, world)}
        for layout in (*LAYOUTS, *EXTRA) if name == "qwen3_moe" else LAYOUTS if name in CASES else ("fsdp",):
            results[name][layout] = _parallel(name, layout, batches, rank, world)
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_two_ranks, 2)


FOUR_RANK_CASES = ("qwen3_moe", "mixtral")


def _four_ranks(rank, world):
    """ep=2 on 4 ranks: each expert on efsdp=2 ranks (FSDP2 shards it there, or its gradient is summed there)."""
    batches = token_batches(MOE_STEPS, MOE_GLOBAL_BATCH)
    return {name: {"ref": _reference(name, batches, world),
                   **{layout: _parallel(name, layout, batches, rank, world) for layout in LAYOUTS}}
            for name in FOUR_RANK_CASES}


@pytest.fixture(scope="module")
def four_rank_runs():
    return run_distributed(_four_ranks, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FOUR_RANK_CASES)
def test_ep2_on_4_ranks_with_expert_fsdp_2_trains_like_one_process(four_rank_runs, name, layout):
    for rank, results in enumerate(four_rank_runs):
        ref, run = results[name]["ref"], results[name][layout]
        assert run["local_experts"] == {2} and min(ref["norms"]) > MAX_NORM
        assert_parity(run, ref, config=moe_config(name), what=f"rank {rank} {name} {layout}")


@pytest.mark.parametrize(("name", "layout"), [(n, lay) for n in CASES for lay in LAYOUTS] +
                         [(n, "fsdp") for n in SWEEP_CASES] + [("qwen3_moe", lay) for lay in EXTRA])
def test_ep2_trains_like_one_process(runs, name, layout):
    for rank, results in enumerate(runs):
        ref, run = results[name]["ref"], results[name][layout]
        assert run["local_experts"] == {2}  # 4 experts, 2 on each rank, in every MoE layer
        assert min(ref["norms"]) > MAX_NORM  # clipping active: the norm over both meshes decides the update
        assert_parity(run, ref, config=moe_config(name), what=f"rank {rank} {name} {layout}")


@pytest.mark.parametrize("name", AUX_CASES)
def test_the_aux_coefficient_is_large_enough_to_fail_the_parity_when_dropped(runs, name):
    """Without the router aux term the weights move by more than the parity tolerance: the test above sees it."""
    batches = token_batches(MOE_STEPS, MOE_GLOBAL_BATCH)
    dropped = _reference(name, batches, 2, aux=0.0)["state"]
    kept = runs[0][name]["ref"]["state"]
    assert max(float((dropped[k] - kept[k]).abs().max()) for k in kept) > 1e-3

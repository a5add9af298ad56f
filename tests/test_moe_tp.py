"""Tensor parallelism for MoE models against one process (``hf_dist/tensor_parallel/moe.py``).

One 2-rank spawn runs TP=2 on qwen3_moe, mixtral, gpt_oss (router aux loss on, coefficient ``ep_cases.AUX``,
non-default top-k / ``norm_topk_prob``; gpt_oss: expert biases, clamped SwiGLU, attention sinks split by head) and
deepseek_v3 (grouped routing, shared expert, first layer dense; its latent attention kept whole on every rank by its
plan): routed experts split along their intermediate dimension, router whole. A 4-rank spawn runs TP=2 x FSDP2 and
TP=2 x replicated dp=2 (qwen3_moe, gpt_oss). Every case: 3 AdamW steps with gradient clipping active (the parity
harness's ``layout_run``); losses, gradient norms, the first step's gradients and every parameter within 1e-5 of one
process. Also: the final save reloads with from_pretrained,
and every layout's sharded checkpoint (split [gate_r | up_r] written block by block) loads into a fresh model and
optimizer of the same layout equal in every value. DistTrainer with checkpoints: ``test_moe_tp_checkpoint.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from ep_cases import moe_config, moe_model, token_batches
from parity import MOE_ADAMW, MOE_GLOBAL_BATCH, MOE_STEPS, assert_parity, layout_run, reference_run, split_rows
from parity import TP_MOE_CASES as TP_CASES

MAX_NORM = MOE_ADAMW.max_norm


def _reference(name: str, batches: list[dict], micro: int) -> dict:
    """One process (the parity harness's reference) running each step as ``micro`` micro-batches."""
    return reference_run(moe_model(name), [split_rows(batch, micro) for batch in batches], MOE_ADAMW, grads=True)


def _tp(name: str, batches: list[dict], rank: int, world: int, ckpt: str, tp: int = 2, layout: str = "tp",
        save_to: str | None = None) -> dict:
    """The harness's ``layout_run`` on TP over ``tp`` ranks; the other ``world // tp`` ranks data-parallel (``layout``:
    FSDP2 or replicated). Then the final save, the checkpoint round trip and (TP alone) a one-process checkpoint."""
    from hf_dist import FsdpRequest, ParallelDims, parallelize
    from hf_dist.state_dict import full_state_dict

    dp = world // tp
    fsdp = layout == "fsdp"
    dims = ParallelDims(world_size=world, tp=tp, dp_shard=dp if fsdp else 1, dp_replicate=1 if fsdp else dp)
    dims.build_mesh("cpu")

    def build():
        model = parallelize(moe_model(name), dims, fsdp=FsdpRequest() if fsdp else None)
        return model, MOE_ADAMW.optimizer_for(model.parameters())

    model, optimizer = build()
    out = layout_run(model, batches, MOE_ADAMW, dp_rank=dims.dp_rank(rank), dp=dp, grads=True, optimizer=optimizer,
                     dp_group=dims.get_mesh("dp").get_group() if dp > 1 else None)
    if save_to is not None:  # the final save (DistTrainer.save_model): gathered, in the model's own key format
        from hf_dist.state_dict import save_gathered

        save_gathered(model, save_to)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    local = {(tuple(m.gate_up_proj.shape), tuple(m.gate_up_proj.to_local().shape)) for m in experts}
    out.update(experts=local, reloaded=_checkpoint_round_trip(f"{ckpt}/{name}_{layout}", model, optimizer, dims, build))
    if layout == "tp":  # a one-process checkpoint (other weights: seed 1) read into the split experts
        from hf_dist.checkpoint import load_checkpoint

        fresh, _ = build()
        load_checkpoint(_one_process_checkpoint(ckpt, name), model=fresh, restore_rng=False)
        saved = _seed1_model(name).state_dict()
        out["from_one_process"] = max(float((v - saved[k]).abs().max()) for k, v in full_state_dict(fresh).items())
    return out


def _one_process_checkpoint(root: str, name: str) -> str:
    return f"{root}/one_process_{name}"


def _seed1_model(name: str):
    from hf_dist.models.tiny import build_tiny_model

    return build_tiny_model(moe_config(name), seed=1)


def _checkpoint_round_trip(path: str, model, optimizer, dims, build) -> dict:
    """Save a sharded checkpoint, load it into a fresh model and optimizer of the same layout: the largest
    difference of any parameter and of any optimizer state tensor (whole tensors)."""
    from hf_dist.checkpoint import load_checkpoint, save_checkpoint

    async_save = dims.dp == 1  # TP alone: through the background writer and its staged copies
    save_checkpoint(path, model=model, optimizer=optimizer, step=MOE_STEPS, samples_consumed=0, layout=dims,
                    batch_contract=None, async_save=async_save).result()
    fresh, fresh_optimizer = build()
    load_checkpoint(path, model=fresh, optimizer=fresh_optimizer, restore_rng=False)
    from torch.distributed.tensor import DTensor

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    pairs = list(zip(model.parameters(), fresh.parameters()))
    params = [(whole(p), whole(q)) for p, q in pairs]
    moments = [(whole(optimizer.state[p][k]), whole(fresh_optimizer.state[q][k]))
               for p, q in pairs for k in ("exp_avg", "exp_avg_sq")]
    return {kind: max(float((a - b).abs().max()) for a, b in found) for kind, found in (("params", params),
                                                                                       ("moments", moments))}


def _two_ranks(rank, world, root):
    batches = token_batches(MOE_STEPS, MOE_GLOBAL_BATCH)
    return {name: {"ref": _reference(name, batches, 1),
                   "tp": _tp(name, batches, rank, world, f"{root}/ckpt", save_to=f"{root}/{name}")}
            for name in TP_CASES}


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_tp_save")


@pytest.fixture(scope="module")
def runs(saved_root):
    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint

    for name in TP_CASES:  # saved by one process, read by the TP=2 ranks
        save_checkpoint(_one_process_checkpoint(f"{saved_root}/ckpt", name), model=_seed1_model(name), optimizer=None,
                        step=0, samples_consumed=0, layout=ParallelDims(world_size=1), batch_contract=None)
    return run_distributed(_two_ranks, 2, str(saved_root))


FOUR_RANK_CASES = ("qwen3_moe", "gpt_oss")
DP_LAYOUTS = ("fsdp", "ddp")


def _four_ranks(rank, world, root):
    """TP=2 x FSDP2 and TP=2 x replicated dp=2 on 4 ranks (gpt_oss: the expert biases under FSDP2 too)."""
    batches = token_batches(MOE_STEPS, MOE_GLOBAL_BATCH)
    return {name: {"ref": _reference(name, batches, 2),
                   **{layout: _tp(name, batches, rank, world, root, layout=layout) for layout in DP_LAYOUTS}}
            for name in FOUR_RANK_CASES}


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    return run_distributed(_four_ranks, 4, str(tmp_path_factory.mktemp("moe_tp_ckpt4")))


@pytest.mark.parametrize("layout", DP_LAYOUTS)
@pytest.mark.parametrize("name", FOUR_RANK_CASES)
def test_tp2_by_dp2_moe_trains_like_one_process(four_rank_runs, name, layout):
    _check(four_rank_runs, name, layout)


@pytest.mark.parametrize("name", TP_CASES)
def test_tp2_moe_trains_like_one_process(runs, name):
    _check(runs, name, "tp")


def _check(runs, name, layout):
    for rank, results in enumerate(runs):
        ref, run = results[name]["ref"], results[name][layout]
        assert min(ref["norms"]) > MAX_NORM  # clipping active
        experts_per_rank = 2 if layout == "fsdp" else 1  # FSDP2 shards the 4 experts (dim 0) over dp=2
        assert run["experts"] and all(  # every expert's gate/up features split in half (dim 1, or 2 transposed)
            whole[0] == experts_per_rank * local[0] and whole[1] * whole[2] == 2 * local[1] * local[2]
            for whole, local in run["experts"])
        assert_parity(run, ref, config=moe_config(name), what=f"rank {rank} {name} {layout}")


@pytest.mark.parametrize("name", TP_CASES)
def test_sharded_checkpoints_under_tp_reload_exactly(runs, four_rank_runs, name):
    """[gate_r | up_r] (concatenated layouts) is two blocks per rank, written and read block by block; gpt-oss
    interleaves gate and up, one block. TP=2 (saved in the background: ``async_save``), and TP=2 x FSDP2 / x DDP on
    4 ranks (qwen3_moe, gpt_oss); a one-process checkpoint read by TP=2."""
    reloads = [result[name]["tp"]["reloaded"] for result in runs]
    if name in FOUR_RANK_CASES:
        reloads += [result[name][layout]["reloaded"] for result in four_rank_runs for layout in DP_LAYOUTS]
    assert reloads and all(r == {"params": 0.0, "moments": 0.0} for r in reloads), reloads
    assert [result[name]["tp"]["from_one_process"] for result in runs] == [0.0, 0.0]  # one process -> TP=2


@pytest.mark.parametrize("name", TP_CASES)
def test_the_final_save_under_tp_reloads_equal_to_one_process(runs, saved_root, name):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(saved_root / name), dtype=torch.float32).state_dict()
    ref = runs[0][name]["ref"]["state"]
    assert loaded.keys() == ref.keys()
    for key, value in ref.items():
        assert_close(loaded[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ("qwen2_moe", "olmoe", "phimoe"))
def test_moe_types_without_a_tp_parity_test_are_refused_by_name(name):
    from hf_dist.tensor_parallel import check_tp_sizes

    with pytest.raises(ValueError, match="tensor parallelism is not available"):
        check_tp_sizes(moe_config(name), 2)


def test_an_expert_width_tp_does_not_divide_is_refused_before_launch():
    from hf_dist.tensor_parallel import check_tp_sizes, valid_tp_sizes

    config = moe_config("qwen3_moe")
    config.moe_intermediate_size = 25
    with pytest.raises(ValueError, match="tp=2 does not divide moe_intermediate_size=25"):
        check_tp_sizes(config, 2)
    assert valid_tp_sizes(moe_config("gpt_oss")) == [1, 2]  # 4 heads, 2 KV heads, intermediate_size=24

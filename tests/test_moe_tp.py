"""Tensor parallelism for MoE models against one process (``hf_dist/tensor_parallel/moe.py``).

One 2-rank spawn runs TP=2 on qwen3_moe, mixtral, gpt_oss (router aux loss on, coefficient ``ep_cases.AUX``,
non-default top-k / ``norm_topk_prob``; gpt_oss: expert biases, clamped SwiGLU, attention sinks split by head) and
deepseek_v3 (grouped routing, shared expert, first layer dense; its latent attention kept whole on every rank by its
plan): routed experts split along their intermediate dimension, router whole. A 4-rank spawn runs TP=2 x FSDP2 and
TP=2 x replicated dp=2 (qwen3_moe, gpt_oss). Every case: 3 AdamW steps with gradient clipping active; losses,
gradient norms and every parameter within 1e-5 of one process. Also: the final save reloads with from_pretrained,
sharded checkpoints of split [gate_r | up_r] are refused, DistTrainer tp_size=2 equals DistTrainer in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed
from ep_cases import moe_config, moe_model, token_batches
from test_expert_parallel import GLOBAL_BATCH, LR, MAX_NORM, STEPS, _reference, _slice

TP_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def _tp(name: str, batches: list[dict], rank: int, world: int, tp: int = 2, layout: str = "tp",
        save_to: str | None = None) -> dict:
    """TP over ``tp`` ranks; the other ``world // tp`` ranks data-parallel (``layout``: FSDP2 or replicated)."""
    from transformers import Trainer

    from hf_dist import FsdpRequest, ParallelDims, parallelize
    from hf_dist.state_dict import full_state_dict

    dp = world // tp
    fsdp = layout == "fsdp"
    dims = ParallelDims(world_size=world, tp=tp, dp_shard=dp if fsdp else 1, dp_replicate=1 if fsdp else dp)
    dims.build_mesh("cpu")
    model = parallelize(moe_model(name), dims, fsdp=FsdpRequest() if fsdp else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches:
        loss = model(**_slice(batch, rank // tp, dp)).loss  # tp is the innermost mesh dimension
        loss.backward()
        norms.append(float(Trainer._mixed_mesh_grad_norm(None, model, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    if save_to is not None:  # the final save (DistTrainer.save_model): gathered, in the model's own key format
        from hf_dist.state_dict import save_gathered

        save_gathered(model, save_to)
    try:
        from hf_dist.checkpoint.api import check_checkpointable

        check_checkpointable(model)
        checkpoint = "allowed"
    except ValueError as error:
        checkpoint = str(error)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    local = {(tuple(m.gate_up_proj.shape), tuple(m.gate_up_proj.to_local().shape)) for m in experts}
    return {"losses": losses, "norms": norms, "state": full_state_dict(model), "experts": local, "checkpoint": checkpoint}


def _two_ranks(rank, world, root):
    batches = token_batches(STEPS, GLOBAL_BATCH)
    return {name: {"ref": _reference(name, batches, 1), "tp": _tp(name, batches, rank, world, save_to=f"{root}/{name}")}
            for name in TP_CASES}


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_tp_save")


@pytest.fixture(scope="module")
def runs(saved_root):
    return run_distributed(_two_ranks, 2, str(saved_root))


FOUR_RANK_CASES = ("qwen3_moe", "gpt_oss")
DP_LAYOUTS = ("fsdp", "ddp")


def _four_ranks(rank, world):
    """TP=2 x FSDP2 and TP=2 x replicated dp=2 on 4 ranks (gpt_oss: the expert biases under FSDP2 too)."""
    batches = token_batches(STEPS, GLOBAL_BATCH)
    return {name: {"ref": _reference(name, batches, 2),
                   **{layout: _tp(name, batches, rank, world, layout=layout) for layout in DP_LAYOUTS}}
            for name in FOUR_RANK_CASES}


@pytest.fixture(scope="module")
def four_rank_runs():
    return run_distributed(_four_ranks, 4)


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
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
        assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), atol=0, rtol=1e-5)
        assert run["state"].keys() == ref["state"].keys()
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], atol=1e-5, rtol=0, msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("name", TP_CASES)
def test_sharded_checkpoints_of_split_gate_up_are_refused_before_any_write(runs, name):
    """DCP stores one block per rank; [gate_r | up_r] is two (concatenated layouts). gpt-oss interleaves gate and
    up, so its shard is one block and it checkpoints."""
    message = runs[0][name]["tp"]["checkpoint"]
    if name == "gpt_oss":
        assert message == "allowed"
    else:
        assert "torch.distributed.checkpoint cannot store" in message and "mlp.experts.gate_up_proj" in message


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


def _trainer(output_dir: str, *, tp: int, save_strategy: str = "no") -> dict:
    from test_expert_parallel_trainer import _model
    from trainer_harness import full_parameters, token_dataset

    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, global_batch_size=8,
        learning_rate=1e-3, report_to=[], seed=0, data_seed=0, disable_tqdm=True, logging_steps=1,
        dataloader_num_workers=0, max_grad_norm=MAX_NORM, save_strategy=save_strategy, use_cpu=tp == 1,
        **({"tp_size": tp} if tp > 1 else {}),
    )
    trainer = DistTrainer(model=_model(), args=args, train_dataset=token_dataset())
    trainer.train()
    logs = trainer.state.log_history
    return {"losses": [log["loss"] for log in logs if "loss" in log],
            "norms": [log["grad_norm"] for log in logs if "grad_norm" in log],
            "params": {k: v.detach().clone() for k, v in full_parameters(trainer).items()}}


def _trainer_ranks(rank, world, root):
    try:
        _trainer(f"{root}/refused", tp=2, save_strategy="steps")
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"tp": _trainer(f"{root}/tp", tp=2), "refused": refused}


def test_dist_trainer_tp2_on_qwen3_moe_equals_one_process(tmp_path):
    """DistTrainer with tp_size=2 (router aux loss on, clipping active) against DistTrainer in one process; with
    checkpoints on, the layout is refused before training (DCP cannot store [gate_r | up_r])."""
    ranks = run_distributed(_trainer_ranks, 2, str(tmp_path))
    ref = _trainer(str(tmp_path / "one"), tp=1)
    assert min(ref["norms"]) > MAX_NORM and len(ref["losses"]) == STEPS
    for rank, result in enumerate(ranks):
        assert "torch.distributed.checkpoint cannot store" in result["refused"], result["refused"]
        run = result["tp"]
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
        assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), atol=0, rtol=1e-5)
        for key, value in ref["params"].items():
            assert_close(run["params"][key], value, atol=1e-5, rtol=0, msg=lambda m: f"rank {rank} {key}: {m}")

"""Expert parallelism's rules without processes: the layout model's ``ep`` (ParallelDims' expert factorisation,
efsdp as transformers derives it), and which models run EP, refused by name otherwise."""

from __future__ import annotations

import pytest
from ep_cases import CASES, SWEEP_CASES, moe_config

from hf_dist.expert_parallel import check_ep_support, ep_refusal
from hf_dist.parallel_dims import ParallelDims
from hf_dist.strategy import Layout


@pytest.mark.parametrize(("strategy", "gpus", "ep", "efsdp"), [
    ("fsdp_full_shard", 8, 8, 1), ("fsdp_full_shard", 8, 2, 4), ("fsdp_shard_grad_op", 4, 4, 1), ("ddp", 8, 4, 2),
])
def test_layout_ep_maps_to_an_expert_factorisation_of_the_data_parallel_ranks(strategy, gpus, ep, efsdp):
    layout = Layout(strategy=strategy, num_gpus=gpus, ep=ep)
    dims = layout.dims
    assert (dims.ep, dims.efsdp, layout.efsdp) == (ep, efsdp, efsdp)
    assert dims.efsdp * dims.ep == dims.dp * dims.tp  # pp x dp x tp == pp x efsdp x ep
    assert layout.owned_by_hf_dist and f"ep{ep}" in layout.name and f"EP{ep}" in layout.describe()


def test_ep_must_divide_the_ranks_experts_spread_over():
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide the 8 ranks \(dp 8 x tp_size 1"
                                         r".*in \[1, 2, 4, 8\]"):
        Layout(strategy="fsdp_full_shard", num_gpus=8, ep=3)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 4 ranks"):
        ParallelDims(world_size=4, dp_shard=-1, ep=3)
    assert ParallelDims(world_size=8, tp=2, dp_shard=-1, ep=4).efsdp == 2  # transformers: fsdp x tp / ep


@pytest.mark.parametrize(("fields", "fix"), [
    (dict(strategy="zero3"), "use FSDP2"), (dict(strategy="fsdp_shard_grad_op", pp=2), "use fsdp_full_shard"),
    (dict(strategy="ddp", tp=2, sequence_parallel=True), "drop tp_sequence_parallel"),
    (dict(strategy="fsdp_full_shard", offload="cpu"), "drop the offload"),
])
def test_products_without_a_parity_test_are_refused_with_the_fix(fields, fix):
    with pytest.raises(ValueError, match=f"ep_size=2.*{fix}"):
        Layout(num_gpus=8, ep=2, **fields)


def test_under_hsdp_the_ep_ranks_lie_inside_one_replica_group():
    """Each replica group holds every expert (``tests/test_ep_hsdp.py``): ep must divide the group, not only dp."""
    layout = Layout(strategy="fsdp_hybrid_shard", num_gpus=8, dp_replicate=2, ep=4)
    assert (layout.dims.dp_replicate, layout.dims.dp_shard, layout.dims.efsdp, layout.dims.expert_replicas) == (
        2, 4, 2, 2)
    with pytest.raises(ValueError, match=r"ep_size=8 with HYBRID_SHARD \(dp_replicate=2\).*divide its 4 ranks.*"
                                         r"ep_size in \[1, 2, 4\]"):
        Layout(strategy="fsdp_hybrid_shard", num_gpus=8, dp_replicate=2, ep=8)
    with pytest.raises(ValueError, match=r"ep=8 does not divide dp_shard=4: under HSDP"):
        ParallelDims(world_size=8, dp_replicate=2, dp_shard=4, ep=8)


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "ddp"])
def test_ep_inside_pipeline_stages_spreads_each_stages_experts_over_its_own_data_parallel_ranks(strategy):
    layout = Layout(strategy=strategy, num_gpus=4, pp=2, ep=2)
    dims = layout.dims
    assert (dims.pp, dims.dp, dims.ep, dims.efsdp) == (2, 2, 2, 1)
    assert "PP2 x EP2" in layout.describe()


def test_ep_x_pp_runs_the_model_types_its_records_prove_and_refuses_the_others_by_name():
    from parity import EP_PP_CASES

    from hf_dist.families import proven_types
    from hf_dist.support import model_refusals

    assert set(EP_PP_CASES) == proven_types("ep_pp")
    layout = Layout(strategy="fsdp_full_shard", num_gpus=4, pp=2, ep=2)
    for name in EP_PP_CASES:
        assert ep_refusal(moe_config(name), 2, pp=2) is None and model_refusals(moe_config(name), layout) == []
    unproven = moe_config("olmoe")  # EP proven, its product with PP not
    assert ep_refusal(unproven, 2) is None
    with pytest.raises(ValueError, match=r"ep_size=2 with pp_size=2 is refused: model_type='olmoe' has no "
                                         r"EP x PP parity case.*proven for deepseek_v3, gpt_oss, mixtral, qwen3_moe"):
        check_ep_support(unproven, 2, 2)
    assert any("no EP x PP parity case" in reason for reason in model_refusals(unproven, layout))


@pytest.mark.parametrize("name", CASES + SWEEP_CASES)
def test_moe_types_with_3d_experts_run_ep(name):
    config = moe_config(name)
    assert ep_refusal(config, 2) is None and ep_refusal(config, 4) is None
    assert "does not divide the 4 experts" in ep_refusal(config, 3)


def test_models_without_3d_experts_are_refused_by_name():
    from transformers import LlamaConfig, Qwen3MoeConfig

    with pytest.raises(ValueError, match=r"model_type='llama' is not a mixture-of-experts model.*set ep_size=1"):
        check_ep_support(LlamaConfig(), 2)
    odd = Qwen3MoeConfig(num_experts=4)
    odd.base_model_ep_plan = {"layers.*.mlp.experts.*.w1": "colwise", "layers.*.mlp.experts": "ep_dispatch_experts"}
    with pytest.raises(ValueError, match="not the 3-D gate_up_proj/down_proj form"):
        check_ep_support(odd, 2)
    bare = Qwen3MoeConfig(num_experts=4)
    bare.base_model_ep_plan = None
    assert "ships no base_model_ep_plan" in ep_refusal(bare, 2)
    check_ep_support(LlamaConfig(), 1)  # ep_size=1 asks nothing of the model


def test_coverage_says_yes_exactly_for_the_parity_tested_types():
    from hf_dist.expert_parallel.support import EP_PARITY_TESTED

    assert sorted(EP_PARITY_TESTED) == sorted(CASES + SWEEP_CASES)


def test_lora_under_ep_runs_with_fsdp2_and_ddp():
    """LoRA trains under EP x FSDP2 and EP x DDP (tests/test_lora_moe.py): neither the layout nor the model check
    refuses it, for a PEFT model handed to DistTrainer too (its rank read from the model)."""
    from types import SimpleNamespace

    from ep_cases import moe_model
    from peft import LoraConfig

    from hf_dist.models import add_adapters
    from hf_dist.models.peft_utils import peft_rank
    from hf_dist.trainer.model_support import check_model_support

    model = add_adapters(moe_model("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"]), seed=0)
    assert peft_rank(model) == 4
    for strategy in ("fsdp_full_shard", "ddp"):
        assert Layout(strategy=strategy, num_gpus=2, ep=2, lora_rank=4).ep == 2
        check_model_support(model.config, SimpleNamespace(layout=Layout(strategy=strategy, num_gpus=2, ep=2)),
                            peft_rank(model))
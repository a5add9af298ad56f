"""The one PP support decision: proven dense model types pass; MoE, hybrid, plan-less and unproven types are
refused by name before any process group starts, by DistTrainer, ``hf-dist pp`` and the planner alike."""

import pytest
from transformers import AutoConfig

from hf_dist.models.tiny import tiny_llama_config
from hf_dist.pipeline_parallel.support import check_pipeline_support, pipeline_refusal

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("mistral", {"sliding_window": 8}),
        ("cohere", {}),
        ("gemma2", {"final_logit_softcapping": 5.0}),
        ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0}),
        ("gemma3_text", {}),
        ("olmo3", {}),
        ("gpt2", {}),  # hf_dist's own pp plans (pipeline_parallel/plans.py)
        ("opt", {"word_embed_proj_dim": 16}),
        ("bloom", {}),
        ("falcon", {"alibi": True, "multi_query": False}),
        ("nemotron", {}),
    ],
)
def test_proven_model_types_are_accepted_with_their_own_fields(model_type, overrides):
    check_pipeline_support(AutoConfig.for_model(model_type, **SMALL, **overrides))


@pytest.mark.parametrize(
    "model_type, reason",
    [
        ("qwen2_moe", "mixture-of-experts model .num_experts=60.; no MoE PP parity case"),
        ("zamba2", "shared attention blocks whose weights would be copied onto every stage"),
        ("xglm", "declares no base_model_pp_plan"),
        ("biogpt", "declares no base_model_pp_plan"),
    ],
)
def test_moe_hybrid_and_planless_types_are_refused_by_name(model_type, reason):
    config = AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match=f"model_type='{model_type}'.*{reason}.*pp_size=1"):
        check_pipeline_support(config)


def test_unproven_type_is_refused_naming_the_missing_test():
    config = tiny_llama_config()
    config.model_type = "my_llama_fork"
    config.base_model_pp_plan = {"embed_tokens": None, "layers": None, "norm": None}
    assert "no PP parity case in tests/test_pp_sweep.py" in pipeline_refusal(config)


def test_cli_and_planner_use_the_same_decision(capsys):
    from hf_dist.cli import main
    from hf_dist.planner.catalogue import ModelSpec
    from hf_dist.planner.chooser import _shape_rule
    from hf_dist.planner.workload import make_layout

    moe = ModelSpec(name="m", model_type="qwen2_moe", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    assert "mixture-of-experts" in _shape_rule(moe, make_layout("fsdp_full_shard", 2, pp=2))
    assert _shape_rule(moe, make_layout("fsdp_full_shard", 2)) is None
    assert main(["pp", "--model", "llama-2-13b", "--pp", "2"]) == 0  # proven type: the split is printed
    capsys.readouterr()


def test_dist_trainer_refuses_before_the_process_group(tmp_path):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_dist import DistTrainer, DistTrainingArguments

    config = AutoConfig.for_model("qwen2_moe", **SMALL, num_experts=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32)
    model = AutoModelForCausalLM.from_config(config)
    import dataclasses

    args = DistTrainingArguments(output_dir=str(tmp_path), pp_size=1, use_cpu=True, report_to=[])
    # the layout a launcher with 2 ranks would resolve; the check reads the model and the layout, not the world
    args.layout = dataclasses.replace(args.layout, pp=2, num_gpus=2)
    with pytest.raises(ValueError, match="model_type='qwen2_moe' is a mixture-of-experts model"):
        DistTrainer(model=model, args=args)
    assert not dist.is_initialized()


def test_opt_layerdrop_is_refused_by_name():
    """OPT's base model draws LayerDrop's skips in its own layer loop, stand-ins of other stages' layers included:
    a stage can lose the hidden states it received, or run into a module another stage owns."""
    check_pipeline_support(AutoConfig.for_model("opt", **SMALL, layerdrop=0.0, dropout=0.1))  # dropout is fine
    refusal = r"model_type='opt' has layerdrop=0.1: .*LayerDrop.*set layerdrop=0.*pp_size=1"
    with pytest.raises(ValueError, match=refusal):
        check_pipeline_support(AutoConfig.for_model("opt", **SMALL, layerdrop=0.1))

"""The pipeline stopgap: configurations the Llama stage module does not reproduce are refused by name."""

import pytest
from transformers import AutoConfig

from hf_dist.models.tiny import tiny_llama_config
from hf_dist.pipeline_parallel.support import check_pipeline_support

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)


def test_plain_llama_is_accepted():
    check_pipeline_support(tiny_llama_config())


@pytest.mark.parametrize(
    "model_type, overrides, field",
    [
        ("mistral", {"sliding_window": 8}, "model_type='mistral'"),
        ("phi3", {"sliding_window": 8}, "model_type='phi3'"),
        ("starcoder2", {"sliding_window": 8}, "model_type='starcoder2'"),
        ("cohere", {}, "model_type='cohere'"),
        ("cohere2", {}, "model_type='cohere2'"),
        ("gemma2", {}, "model_type='gemma2'"),
        ("gemma2", {"final_logit_softcapping": 5.0}, "model_type='gemma2'"),
        ("granite", {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
                     "attention_multiplier": 0.0078}, "model_type='granite'"),
        ("gemma3_text", {}, "model_type='gemma3_text'"),
        ("olmo3", {}, "model_type='olmo3'"),
        ("qwen2", {}, "model_type='qwen2'"),
    ],
)
def test_untested_model_types_are_refused_by_name(model_type, overrides, field):
    config = AutoConfig.for_model(model_type, **SMALL, **overrides)
    with pytest.raises(ValueError, match=field):
        check_pipeline_support(config)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"logit_scale": 0.0625}, "logit_scale=0.0625"),
        ({"logits_scaling": 8.0}, "logits_scaling=8.0"),
        ({"embedding_multiplier": 12.0}, "embedding_multiplier=12.0"),
        ({"residual_multiplier": 0.22}, "residual_multiplier=0.22"),
        ({"final_logit_softcapping": 5.0}, "final_logit_softcapping=5.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"sliding_window": 8}, "sliding_window=8"),
    ],
)
def test_llama_with_fields_the_stages_ignore_is_refused(overrides, field):
    config = tiny_llama_config()
    for name, value in overrides.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=field):
        check_pipeline_support(config)


def test_dist_trainer_refuses_before_the_process_group(tmp_path):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_dist import DistTrainer, DistTrainingArguments

    config = AutoConfig.for_model("cohere", **SMALL)
    model = AutoModelForCausalLM.from_config(config)
    args = DistTrainingArguments(output_dir=str(tmp_path), pp_size=1, use_cpu=True, report_to=[])
    args.pp_size = 2  # as a launcher with 2 ranks would have it; the check reads the model, not the world
    with pytest.raises(ValueError, match="model_type='cohere'"):
        DistTrainer(model=model, args=args)
    assert not dist.is_initialized()

"""Tensor-parallel plans and size checks, without processes: the errors users see before anything runs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hf_dist.tensor_parallel import check_tp_sizes, plan_names, supported_families, valid_tp_sizes
from hf_dist.tensor_parallel.plans import resolve_styles
from hf_dist.tensor_parallel.styles import FusedColwiseParallel, deinterleave_parts, interleave_parts
from parity import tiny_config as harness_config
from parity import tiny_model


def tiny_config(case: str, **changes):
    """The parity harness's TP config of ``case`` (``tp_sweep_cases``: 4 heads of 8, 2 KV heads, hidden 64, MLP 96,
    vocab 256, tied head where the type's default is untied) with ``changes`` set on it."""
    config = harness_config(case, "tp")
    for field, value in changes.items():
        setattr(config, field, value)
    return config


def test_kv_heads_that_fit_neither_way_name_value_and_valid_sizes():
    config = tiny_config("llama", num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 neither divides nor is divided by tp=2.*\{1, 3, 6\}"):
        check_tp_sizes(config, 2)


def test_gqa_and_mqa_kv_heads_split_or_replicated():
    config = tiny_config("llama", intermediate_size=128)  # 4 heads, 2 kv heads
    check_tp_sizes(config, 2)  # one KV head per rank
    check_tp_sizes(config, 4)  # KV heads replicated: each rank keeps the one its query heads use
    check_tp_sizes(tiny_config("llama", num_key_value_heads=1), 4)  # MQA
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4, intermediate_size=128"):
        check_tp_sizes(config, 3)
    names = plan_names(config, tp=4, sequence_parallel=True)
    assert names["model.layers.*.self_attn.k_proj"] == "replicated_kv"
    assert names["model.layers.*.self_attn"] == "gather_sequence_kwarg+local_head_counts"
    # without sequence parallelism the attention input enters as a replicated DTensor (one backward all-reduce)
    assert plan_names(config, tp=2)["model.layers.*.self_attn"] == "replicated_input_kwarg"
    assert plan_names(config, tp=4)["model.layers.*.self_attn"] == "replicated_input_kwarg+local_head_counts"
    assert "model.layers.*.self_attn" not in plan_names(config, tp=2, lora=True)


def test_fused_families_refuse_fewer_kv_heads_than_ranks():
    with pytest.raises(ValueError, match=r"tp=4 is larger than num_key_value_heads=2.*model_type='phi3'"):
        plan_names(tiny_config("phi3"), tp=4)


def test_vocab_checked_only_when_sharded():
    config = tiny_config("llama", vocab_size=511)
    check_tp_sizes(config, 2)
    with pytest.raises(ValueError, match=r"vocab_size=511.*pad the vocabulary"):
        check_tp_sizes(config, 2, vocab_parallel=True)
    assert valid_tp_sizes(config, vocab_parallel=True) == [1]


def test_intermediate_size_checked():
    with pytest.raises(ValueError, match=r"intermediate_size=130"):
        check_tp_sizes(tiny_config("llama", intermediate_size=130, num_attention_heads=4, num_key_value_heads=4), 4)


@pytest.mark.parametrize("model_type", ["xglm", "biogpt"])
def test_types_without_a_plan_are_refused_by_name_not_crashing(model_type):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    assert valid_tp_sizes(config) == [1]
    check_tp_sizes(config, 1)
    refusal = rf"model_type='{model_type}': transformers ships no base_model_tp_plan.*plan="
    with pytest.raises(ValueError, match=refusal):
        check_tp_sizes(config, 2)
    with pytest.raises(ValueError, match="no base_model_tp_plan"):
        plan_names(config)


def test_classic_plans_check_the_sizes_they_split():
    """hf_dist's own plans (classic.py): heads and the MLP width from the config's own names, KV heads of
    Falcon's layouts, refusals by name before anything is built."""
    from transformers import AutoConfig

    assert valid_tp_sizes(AutoConfig.for_model("gpt2")) == [1, 2, 3, 4, 6, 12]  # 12 heads, 4 x 768 MLP
    with pytest.raises(ValueError, match=r"tp=5 does not divide num_attention_heads=12, mlp_width=3072"):
        check_tp_sizes(AutoConfig.for_model("gpt2"), 5)
    assert valid_tp_sizes(AutoConfig.for_model("gpt2", n_inner=100)) == [1, 2, 4]
    falcon_mqa = AutoConfig.for_model("falcon")  # default: one KV head for all query heads
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by tp=2"):
        check_tp_sizes(falcon_mqa, 2)
    grouped = AutoConfig.for_model("falcon", num_attention_heads=8, hidden_size=64, new_decoder_architecture=True,
                                   num_kv_heads=2)
    assert valid_tp_sizes(grouped) == [1, 2]
    with pytest.raises(ValueError, match="model_type='falcon': alibi=True"):
        check_tp_sizes(AutoConfig.for_model("falcon", multi_query=False, alibi=True), 2)
    assert plan_names(AutoConfig.for_model("bloom"), tp=2)["transformer.h.*.self_attention"] == "local_attrs+local_alibi"
    assert valid_tp_sizes(AutoConfig.for_model("bloom")) == [1, 2, 4, 8]  # default: 8 heads, 4 x 64 MLP


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [("qwen2_moe", "MoE experts: no TP parity test"), ("longcat_flash", "MoE experts"), ("minicpm3", "multi-head latent attention"), ("granite_swa", "attention sinks"),
     ("olmo_hybrid", "Gated DeltaNet has no TP overlay"), ("zamba2", "shared attention blocks"), ("nemotron_h", "MoE experts"),
     ("mamba", "linear-attention"), ("jetmoe", "MoE experts")],
)
def test_plans_hf_dist_cannot_shard_are_refused_with_the_reason(model_type, reason):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=rf"model_type='{model_type}': {reason}"):
        check_tp_sizes(AutoConfig.for_model(model_type), 2)


def test_overlays_for_config_values_the_models_plan_alone_gets_wrong():
    from transformers import CohereConfig, OlmoConfig

    cohere = plan_names(CohereConfig(use_qk_norm=True), tp=2)
    assert cohere["model.layers.*.self_attn.q_norm"] == "head_sharded_norm"  # one weight row per head
    assert "model.layers.*.self_attn.q_norm" not in plan_names(CohereConfig(), tp=2)
    olmo = plan_names(OlmoConfig(clip_qkv=8.0), tp=2)  # clamps q/k/v in place: the model gets a copy
    assert olmo["model.layers.*.self_attn.k_proj"] == "colwise_writable_output"
    assert plan_names(OlmoConfig(), tp=2)["model.layers.*.self_attn.k_proj"] == "colwise"


def test_sizes_come_from_what_the_plan_shards():
    from transformers import Olmo2Config, Starcoder2Config

    # StarCoder2's MLP is c_fc/c_proj under "mlp": its intermediate_size is split
    with pytest.raises(ValueError, match="intermediate_size=6"):
        check_tp_sizes(
            Starcoder2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=6), 4
        )
    # OLMo-2 splits q/k/v (gathered) and the MLP: heads and MLP width both count, and only they do
    config = Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96)
    assert valid_tp_sizes(config) == [1, 2, 4]


@pytest.mark.parametrize("case", ["llama", "llama:untied", "mistral", "qwen2", "qwen3", "gpt_neox"])
def test_the_models_own_plan_is_used(case):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = tiny_config(case)
    names = plan_names(config, tp=2)
    prefix = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].base_model_prefix
    expected = {f"{prefix}.{k}": v for k, v in type(config).base_model_tp_plan.items()
                if v != "embedding_rowwise"}  # transformers 5.24's embedding entry: kept whole without vocab TP
    if not config.tie_word_embeddings:
        expected["lm_head"] = "colwise_gather_output"  # the head's own plan: untied, vocab 256 divides by 2
    if case != "gpt_neox":  # hf_dist's overlay: the replicated input of attention and MLP enters as a DTensor
        expected |= {"model.layers.*.self_attn": "replicated_input_kwarg", "model.layers.*.mlp": "replicated_input"}
    assert names == expected
    styles = resolve_styles(names, config)
    assert all(isinstance(style, (ColwiseParallel, RowwiseParallel)) for name, style in styles.items()
               if not name.endswith("_norm") and name not in ("model.layers.*.self_attn", "model.layers.*.mlp"))


def test_head_kept_whole_when_tied_or_uneven():
    assert "lm_head" not in plan_names(tiny_config("qwen2", tie_word_embeddings=True), tp=2)
    assert "lm_head" not in plan_names(tiny_config("llama:untied", vocab_size=511), tp=2)
    assert "lm_head" in plan_names(tiny_config("llama:untied"), tp=2)


@pytest.mark.parametrize(("case", "head"), [("llama", "whole_lm_head_from_sequence_shards"),
                                             ("llama:untied", "lm_head_from_sequence_shards")])
def test_sequence_parallelism_splits_the_head_only_where_the_plan_does(case, head):
    """A tied head kept whole takes the gathered sequence: split by columns it was untied from the whole embedding."""
    assert plan_names(tiny_config(case), tp=2, sequence_parallel=True)["lm_head"] == head


def test_supported_families_are_the_tested_types():
    assert {"llama", "phi3", "gemma2", "olmo2", "starcoder2"} <= set(supported_families())


def test_overlays_refused_for_families_they_do_not_fit():
    with pytest.raises(ValueError, match=r"not for model_type='gpt_neox'"):
        plan_names(tiny_config("gpt_neox"), sequence_parallel=True)


class _FakeMesh:
    """Enough of a 1-D DeviceMesh for the checks that run before any collective."""

    ndim = 1

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_apply_checks_sizes_before_touching_the_model():
    from hf_dist.tensor_parallel import apply_tensor_parallel

    model = tiny_model(tiny_config("llama"))  # 4 heads, 2 kv heads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4"):
        apply_tensor_parallel(model, _FakeMesh(3))
    with pytest.raises(ValueError, match=r"plan="):
        apply_tensor_parallel(model, _FakeMesh(2), plan={}, vocab_parallel=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fused_overlay_shards_phi3_parts_instead_of_gathering():
    config = tiny_config("phi3")  # 4 heads x 16, 2 kv heads, intermediate 96
    styles = resolve_styles(plan_names(config), config)
    assert styles["model.layers.*.self_attn.qkv_proj"].parts == (64, 32, 32)
    assert styles["model.layers.*.mlp.gate_up_proj"].parts == (96, 96)
    assert isinstance(styles["model.layers.*.mlp.gate_up_proj"], FusedColwiseParallel)


def test_overlays_add_sequence_and_vocab_entries():
    names = plan_names(tiny_config("llama"), sequence_parallel=True, vocab_parallel=True)
    assert names["model.layers.*.input_layernorm"] == "sequence_parallel"
    assert names["model.layers.*.self_attn.o_proj"] == "rowwise_to_sequence_shards"
    assert names["lm_head"] == "vocab_lm_head_from_sequence_shards"
    assert names["model.embed_tokens"] == "vocab_embedding_to_sequence_shards"


def test_sequence_gather_keeps_what_the_plan_does_on_the_module():
    # Phi-3's fused q/k/v needs its attention to count local heads; the sequence overlay once replaced that entry
    names = plan_names(tiny_config("phi3"), sequence_parallel=True)
    assert names["model.layers.*.self_attn"] == "gather_sequence_kwarg+local_head_counts"
    assert names["model.layers.*.mlp"] == "gather_sequence"


def test_interleave_gives_each_rank_its_slice_of_every_part_and_inverts():
    weight = torch.arange(12.0).unsqueeze(1)  # parts of 4, 4, 4 rows
    reordered = interleave_parts(weight, (4, 4, 4), 2)
    assert reordered.squeeze(1).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(deinterleave_parts(reordered, (4, 4, 4), 2), weight)
    uneven = torch.arange(8.0).unsqueeze(1)  # GQA-like: 4 + 2 + 2
    assert torch.equal(deinterleave_parts(interleave_parts(uneven, (4, 2, 2), 2), (4, 2, 2), 2), uneven)


def test_embedding_rowwise_is_the_vocab_parallel_embedding_or_kept_whole():
    """transformers 5.24 names input embeddings ``embedding_rowwise``: whole without vocab parallelism (as the
    parity tests run them), the vocab-parallel embedding with it; the style itself resolves to that embedding."""
    from torch.distributed.tensor import Replicate

    from hf_dist.tensor_parallel.plans import base_plan

    config = tiny_config("gpt_neox")
    config.base_model_tp_plan = {**type(config).base_model_tp_plan, "embed_in": "embedding_rowwise"}  # 5.24's plan
    assert "gpt_neox.embed_in" not in plan_names(config, tp=2)
    assert base_plan(config, 2, vocab_parallel=True)["gpt_neox.embed_in"] == "vocab_embedding"
    style = resolve_styles({"gpt_neox.embed_in": "embedding_rowwise"}, config)["gpt_neox.embed_in"]
    assert isinstance(style, RowwiseParallel) and style.input_layouts == (Replicate(),)
    assert style.output_layouts == (Replicate(),)


@pytest.mark.parametrize("model_type", ["gptj", "gpt_oss", "gpt2"])
def test_the_registry_chooses_hf_dists_plan_even_where_transformers_ships_one(model_type):
    """gptj and gpt_oss: hf_dist's plans (their records' tp_classic / tp_base_plan) are the ones their parity tests prove; a plan
    transformers adds later (5.24: gptj's full plan, gpt_oss's embedding-only plan) does not replace them."""
    from transformers import AutoConfig

    from hf_dist.families import family
    from hf_dist.tensor_parallel.support import model_plan

    record = family(model_type)
    assert record.tp_plan == "hf_dist"
    config = AutoConfig.for_model(model_type)
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", "h.*.attn.q_proj": "colwise"}  # upstream's
    plan = model_plan(config)
    if record.tp_classic is not None:
        assert plan == record.tp_classic.plan_for(config)
    else:
        assert plan["model.layers.*.self_attn"] == "local_sinks"
        assert {p.removeprefix("model.") for p in plan} >= set(record.tp_base_plan)


def test_codegen_is_refused_by_name_whether_or_not_transformers_ships_its_plan():
    """Its qkv_proj is packed in blocks of mp_num=4: transformers' plain column split (5.24) is not proven."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("codegen")
    config.base_model_tp_plan = {"h.*.attn.qkv_proj": "colwise", "h.*.attn.out_proj": "rowwise"}
    for candidate in (config, AutoConfig.for_model("codegen")):
        with pytest.raises(ValueError, match="model_type='codegen': its qkv_proj packs q, v and k in blocks"):
            check_tp_sizes(candidate, 2)

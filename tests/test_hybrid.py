"""Hybrid (linear-attention / short-conv / Mamba2) models outside the parity sweeps: the sizes the TP overlays
(hf_dist/tensor_parallel/hybrid.py) split are checked before launch, what they cannot shard exactly is refused
by name, and the launch canary of PP runs on tiny twins of full-size hybrid configs. Parity itself:
tests/test_tp_sweep.py and tests/test_pp_sweep.py."""

from __future__ import annotations

import importlib.util

import pytest
from transformers import AutoConfig

from hf_dist.tensor_parallel import check_tp_sizes
from dist_utils import run_distributed
from hf_dist.tensor_parallel.support import tp_refusal
from pp_sweep_cases import HYBRID


def _config(name: str, **changes):
    model_type, values = HYBRID[name]
    return AutoConfig.for_model(model_type, **{**values, **changes})


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("qwen3_5_text:deltanet", {"linear_num_key_heads": 1, "linear_num_value_heads": 3},
         "tp=2 does not divide.*linear_num_key_heads=1, linear_num_value_heads=3"),
        ("falcon_h1:mamba2", {"mamba_n_groups": 1}, "tp=2 does not divide.*mamba_n_groups=1"),
        ("bamba:mamba2", {"mamba_n_groups": 1}, "tp=2 does not divide.*mamba_n_groups=1"),
        ("lfm2:conv", {"hidden_size": 33, "num_attention_heads": 3, "num_key_value_heads": 3},
         r"tp=2 does not divide.*hidden_size \(short-conv channels\)=33"),
    ],
)
def test_sizes_the_overlays_split_are_checked_before_launch(name, changes, message):
    with pytest.raises(ValueError, match=message):
        check_tp_sizes(_config(name, **changes), 2)


def test_every_hybrid_case_is_accepted_at_tp2():
    for name in ("qwen3_5_text:deltanet", "lfm2:conv", "falcon_h1:mamba2", "bamba:mamba2"):
        check_tp_sizes(_config(name), 2)


def test_fused_mamba_kernel_is_refused(monkeypatch):
    """With mamba_ssm installed the fused training path applies out_proj.weight whole: refused, not wrong."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "mamba_ssm" else real(n, *a))
    assert "mamba_ssm is installed" in tp_refusal(_config("falcon_h1:mamba2"))
    assert tp_refusal(_config("lfm2:conv")) is None  # no Mamba2 mixer: unaffected


def _full_size_configs() -> dict:
    """Published-size configs (defaults), with their layer patterns moved: what a user would train."""
    return {
        "qwen3_5_text": AutoConfig.for_model("qwen3_5_text"),
        "lfm2": AutoConfig.for_model("lfm2", full_attn_idxs=[2, 5, 8]),
        "falcon_h1": AutoConfig.for_model("falcon_h1", mamba_n_groups=2),
        "bamba": AutoConfig.for_model("bamba", attn_layer_indices=[3, 9]),
        "olmo_hybrid": AutoConfig.for_model("olmo_hybrid", linear_num_key_heads=8, linear_num_value_heads=16,
                                            linear_key_head_dim=32, linear_value_head_dim=32),
    }


def test_twin_of_a_hybrid_keeps_its_layer_kinds_and_crosses_chunks():
    from hf_dist.models.twin import tiny_twin

    bamba = tiny_twin(_full_size_configs()["bamba"])
    assert set(bamba.layers_block_type) == {"linear_attention", "full_attention"}
    assert bamba.mamba_chunk_size == 8 < 32 and bamba.mamba_n_heads * bamba.mamba_d_head == 2 * bamba.hidden_size
    falcon = tiny_twin(_full_size_configs()["falcon_h1"], width=2)
    assert falcon.mamba_n_groups == 4 and falcon.mamba_d_ssm == falcon.mamba_n_heads * falcon.mamba_d_head
    lfm2 = tiny_twin(_full_size_configs()["lfm2"])
    assert set(lfm2.layer_types) == {"conv", "full_attention"}


def _canaries(rank, world_size):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig
    from hf_dist.pipeline_parallel.canary import check_pipeline_layout

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    passed = []
    for name, config in _full_size_configs().items():
        check_pipeline_layout(config, dims, PipelineConfig(schedule="1f1b", microbatches=4))  # raises on a difference
        passed.append(name)
    return passed


def test_pp_launch_canary_passes_on_full_size_hybrid_configs():
    assert run_distributed(_canaries, 2, timeout_s=600)[0] == list(_full_size_configs())


@pytest.mark.parametrize("name", ["qwen3_5_text:deltanet", "lfm2:conv", "falcon_h1:mamba2", "bamba:mamba2"])
def test_every_overlay_pattern_names_modules_of_the_whole_model(name):
    """On a pipeline stage a layer-kind pattern may match nothing; on the whole model each must match."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.tensor_parallel.match import match_plan
    from hf_dist.tensor_parallel.plans import HEAD_PATTERNS, plan_names

    config = _config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = plan_names(config, tp=2)
    match_plan(model, dict.fromkeys(names, None), optional=HEAD_PATTERNS)  # raises on a pattern matching nothing
    assert any("linear_attn" in p or ".conv" in p or ".mamba" in p for p in names)


def _pp_tp_canaries(rank, world_size):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig
    from hf_dist.pipeline_parallel.canary import check_pipeline_layout

    dims = ParallelDims(world_size=4, pp=2, tp=2, dp_shard=1)
    dims.build_mesh("cpu")
    configs = _full_size_configs()
    configs["lfm2"] = AutoConfig.for_model("lfm2", full_attn_idxs=[3, 5, 8], tie_word_embeddings=False)
    configs["bamba"] = AutoConfig.for_model("bamba", attn_layer_indices=[3, 9], mamba_n_groups=2)
    del configs["olmo_hybrid"]  # refused under TP by name
    for config in configs.values():
        # twin layers [linear x3, attention]: the first stage owns no attention layer, its patterns match nothing
        check_pipeline_layout(config, dims, PipelineConfig(schedule="1f1b", microbatches=4))
    return sorted(configs)


def test_pp2_tp2_of_hybrids_equals_one_process_on_their_twins():
    """The launch canary: a PP=2 x TP=2 step of each twin gives the unsplit twin's loss and gradients."""
    assert run_distributed(_pp_tp_canaries, 4, timeout_s=600)[0] == ["bamba", "falcon_h1", "lfm2", "qwen3_5_text"]

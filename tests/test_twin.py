"""``tiny_twin`` (pure, one process): the twin of a config is a config its class accepts and its model runs.

- a model with fewer layers than the twin and explicit ``layer_types`` (gpt_oss, qwen3_5_text, lfm2 at 2 layers)
  gets one type per twin layer, the original's pattern repeated (the config class refuses any other count);
- multi-head latent attention (deepseek_v3 with its default ``num_key_value_heads=128`` on a small model) gets
  one key/value head per query head and the head sizes its class derives from the twin's ranks, so a padded
  batch runs (a "grouped" twin repeated 4 latent key heads to 8 against 4 query heads in sdpa).
"""

from __future__ import annotations

import pytest
import torch

from hf_dist.models.twin import tiny_twin

TWO_LAYERS = {
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},  # its default types: sliding, full
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
}

# deepseek_v3 as a user writes a small one: sizes set, num_key_value_heads left at its default (128)
MLA = {
    "hidden64_layers4": {"hidden_size": 64, "num_hidden_layers": 4},
    "hidden32_layers2": {"hidden_size": 32, "num_hidden_layers": 2},
}
MLA_COMMON = {"num_attention_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
              "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 16, "kv_lora_rank": 16,
              "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 12, "v_head_dim": 12}


def padded_batch(vocab: int, rows: int = 3, seq: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = (torch.arange(seq).unsqueeze(0) < torch.tensor([seq, seq // 2, seq - 3]).unsqueeze(1)).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def two_layer_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, num_hidden_layers=2, **TWO_LAYERS[model_type])


def mla_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("deepseek_v3", **MLA_COMMON, **MLA[name])


@pytest.mark.parametrize("model_type", sorted(TWO_LAYERS))
def test_twin_of_a_two_layer_model_repeats_its_layer_pattern(model_type):
    config = two_layer_config(model_type)
    original = list(config.layer_types)
    assert len(set(original)) == 2  # two kinds of layer: the pattern is visible
    twin = tiny_twin(config, layers=4)
    assert twin.num_hidden_layers == 4
    assert twin.layer_types == original * 2
    assert tiny_twin(config, layers=5).layer_types == original * 2 + original[:1]


def test_twin_with_fewer_layers_still_keeps_every_kind():
    from transformers import AutoConfig

    config = AutoConfig.for_model("lfm2", num_hidden_layers=6, layer_types=["conv"] * 5 + ["full_attention"])
    assert tiny_twin(config, layers=4).layer_types == ["conv", "conv", "conv", "full_attention"]


@pytest.mark.parametrize("name", sorted(MLA))
def test_mla_twin_has_one_kv_head_per_query_head_and_runs_a_padded_batch(name):
    from transformers import AutoModelForCausalLM

    config = mla_config(name)
    assert config.num_key_value_heads == 128 != config.num_attention_heads
    for width in (1, 2):
        twin = tiny_twin(config, width=width)
        assert twin.num_key_value_heads == twin.num_attention_heads == 4 * width
        assert twin.qk_head_dim == twin.qk_nope_head_dim + twin.qk_rope_head_dim
        assert twin.head_dim == twin.qk_rope_head_dim  # deepseek_v3's rotary width, derived by its class
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_twin(config)).float()
    loss = model(**padded_batch(model.config.vocab_size)).loss
    assert torch.isfinite(loss)

"""Runtime MFU uses the planner's FLOP formula: the same counts off a live module (full, tied, LoRA), non-padding
tokens, and the one GPU catalogue for the device peak. Pure: no process group."""

from __future__ import annotations

import pytest
import torch

from hf_dist.planner import Workload, model_spec
from hf_dist.planner.catalogue import gpu_from_device_name
from hf_dist.planner.flops import module_flop_counts
from hf_dist.planner.throughput import flop_counts, flops_per_token
from hf_dist.trainer.throughput import ThroughputMeter, useful_tokens

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            intermediate_size=96)


def _model(tie: bool = False):
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    config = tiny_llama_config(**TINY, tie_word_embeddings=tie)
    return config, build_tiny_model(config)


@pytest.mark.parametrize("tie", [False, True])
def test_module_counts_equal_the_planners(tie):
    config, model = _model(tie)
    assert module_flop_counts(model) == flop_counts(model_spec(config))


def test_lora_counts_frozen_weights_at_four_flops():
    from peft import LoraConfig, get_peft_model

    config, model = _model()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    counts = module_flop_counts(peft_model)
    planned = flop_counts(model_spec(config), lora_rank=4)
    # PEFT leaves lm_head frozen too: the base's matmuls, all at 4 FLOPs per weight
    assert counts == planned
    full = flop_counts(model_spec(config))
    assert counts.per_token(32)[0] < full.per_token(32)[0]


def test_meter_counts_model_flops_of_the_non_padding_tokens_only():
    config, model = _model()
    meter = ThroughputMeter(flops=module_flop_counts(model), model_parallel=1, peak_flops=1e12, recompute=True)
    ids = torch.randint(0, 256, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0  # six pads
    labels = ids.masked_fill(mask == 0, -100)
    meter.count({"input_ids": ids, "attention_mask": mask, "labels": labels})
    spec = model_spec(config)
    model_flops, executed = flops_per_token(spec, Workload(seq_len=16, activation_checkpointing=True))
    assert meter._model_flops == model_flops * 26  # the planner's formula x useful tokens
    assert meter._hardware_flops == executed * 32  # recompute over every processed token
    logs = meter.report()
    assert logs["useful_tokens_per_second"] / logs["tokens_per_second"] == pytest.approx(26 / 32)
    assert "mfu" in logs and logs["hfu"] > logs["mfu"]
    assert useful_tokens({"input_ids": ids, "labels": labels}) == 26 and useful_tokens({"input_ids": ids}) == 32


@pytest.mark.parametrize("device, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA A100-SXM4-40GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA A10G", 70e12), ("NVIDIA A10", 125e12), ("NVIDIA H200", 989e12),
    ("NVIDIA B200", 2250e12),
])
def test_one_gpu_catalogue_names_exact_variants(device, peak):
    assert gpu_from_device_name(device).peak_bf16_flops == peak

"""``hf-dist plan --calibrate``: measured steps of a scaled-down model give the efficiency the forecast uses;
``--lengths`` discounts padding. Tiny model, one process, a second or two."""

from __future__ import annotations

import dataclasses

import pytest

from hf_dist.planner import PlanRequest, Workload, choose_layout, gpu_spec, model_spec
from hf_dist.planner.calibrate import calibrate, read_lengths, useful_fraction
from hf_dist.planner.throughput import efficiency, flops_per_token


def _tiny():
    from hf_dist.models.tiny import tiny_llama_config

    return model_spec(tiny_llama_config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=256))


def test_calibration_measures_the_scaled_down_model_and_the_plan_uses_it():
    spec = _tiny()
    workload = Workload(seq_len=16, micro_batch_size=2, precision="fp32", activation_checkpointing=True)
    result = calibrate(spec, workload, layers=2, steps=1, device="cpu")
    executed = flops_per_token(dataclasses.replace(spec, num_hidden_layers=2), workload)[1]
    assert result.efficiency == pytest.approx(executed * 32 / (result.step_time_s * result.peak_flops))
    assert "2-layer" in result.source and "measured" in result.source
    req = PlanRequest(model=spec, gpu=gpu_spec("a100-80gb"), num_gpus=2, seq_len=16, global_batch=4,
                      base_efficiency=result.efficiency, efficiency_source=result.source)
    chosen = choose_layout(req).chosen
    assert chosen.throughput.efficiency_source == result.source
    assert chosen.throughput.efficiency == pytest.approx(
        efficiency(chosen.layout, gpus_per_node=2, accumulation=chosen.batch.gradient_accumulation_steps,
                   base=result.efficiency))
    assumed = choose_layout(dataclasses.replace(req, base_efficiency=None, efficiency_source=None)).chosen
    assert "assumed" in assumed.throughput.efficiency_source


def test_lengths_discount_padding(tmp_path):
    (tmp_path / "lengths.txt").write_text("10\n20\n40\n")
    lengths = read_lengths(tmp_path / "lengths.txt")
    assert useful_fraction(lengths, 32) == pytest.approx((10 + 20 + 32) / 96)
    req = PlanRequest(model=_tiny(), gpu=gpu_spec("a100-80gb"), num_gpus=2, seq_len=32, global_batch=4,
                      useful_fraction=useful_fraction(lengths, 32))
    t = choose_layout(req).chosen.throughput
    assert t.useful_tokens_per_s == pytest.approx(t.tokens_per_s * 62 / 96)
    (tmp_path / "bad.txt").write_text("10\nx\n")
    with pytest.raises(ValueError, match="one integer per line"):
        read_lengths(tmp_path / "bad.txt")

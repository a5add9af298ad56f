"""``hf-dist plan --calibrate``: measured steps of a scaled-down model give the efficiency the forecast uses, on
one device or with the chosen layout's parallelism on 2 real gloo ranks; ``--lengths`` discounts padding.
Tiny model (hidden 64, 2 of 4 layers, vocab 256), 1-2 measured steps; no assertion on wall-clock."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hf_dist.planner import PlanRequest, Workload, choose_layout, gpu_spec, make_layout, model_spec
from hf_dist.planner.calibrate import calibrate, calibration_layout, efficiency_from, read_lengths, useful_fraction
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
    assert "2-layer" in result.source and "measured" in result.source and "one device" in result.source
    assert result.ranks == 1 and result.measured_tp == 1
    req = PlanRequest(model=spec, gpu=gpu_spec("a100-80gb"), num_gpus=2, seq_len=16, global_batch=4,
                      base_efficiency=result.efficiency, efficiency_source=result.source)
    chosen = choose_layout(req).chosen
    assert chosen.throughput.efficiency_source == result.source
    assert chosen.throughput.efficiency == pytest.approx(
        efficiency(chosen.layout, accumulation=chosen.batch.gradient_accumulation_steps, base=result.efficiency))
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


def test_calibration_layout_scales_the_chosen_layout_to_the_ranks_at_hand():
    tp_sp = calibration_layout(make_layout("fsdp_full_shard", 8, tp=4, sequence_parallel=True), 2)
    assert (tp_sp.strategy, tp_sp.tp, tp_sp.dims.dp, tp_sp.sequence_parallel) == ("fsdp_full_shard", 2, 1, True)
    zero = calibration_layout(make_layout("zero3", 8, offload="cpu"), 4)
    assert (zero.strategy, zero.tp, zero.dims.dp, zero.offload) == ("fsdp_full_shard", 1, 4, "none")
    assert calibration_layout(make_layout("zero2", 8), 2).strategy == "fsdp_shard_grad_op"
    pp = calibration_layout(make_layout("ddp", 8, tp=2, pp=2), 2)
    assert (pp.strategy, pp.tp, pp.pp) == ("ddp", 2, 1)
    odd = calibration_layout(make_layout("ddp", 8, tp=2), 3)  # gcd: TP cannot split over 3 ranks
    assert (odd.tp, odd.dims.dp) == (1, 3)
    with pytest.raises(ValueError, match="ranks=0"):
        calibration_layout(make_layout("ddp", 2), 0)


def test_the_efficiency_is_compute_only_communication_is_timed_apart():
    """A calibrated (or assumed) efficiency is not discounted for TP or cross-node gathers: their bytes are timed over
    the links (``communication.py``); only offload and the pipeline bubble scale it."""
    assert efficiency(make_layout("fsdp_full_shard", 16, tp=2), accumulation=4, base=0.3) == pytest.approx(0.3)
    assert efficiency(make_layout("fsdp_full_shard", 8, pp=2), accumulation=4, base=0.3) == pytest.approx(0.3 * 4 / 5)
    assert efficiency(make_layout("zero3", 8, offload="cpu"), accumulation=4, base=0.3) == pytest.approx(0.3 * 0.4)


def test_calibration_runs_the_layouts_parallelism_on_two_gloo_ranks():
    from hf_dist.cli.calibrate_ranks import calibrate_layouts_on_ranks

    spec = _tiny()
    workload = Workload(seq_len=16, micro_batch_size=2, precision="fp32", activation_checkpointing=True)
    cases = (  # (chosen layout, what runs on 2 ranks, dp, tp): both in one process group
        (make_layout("zero3", 8), "FSDP2 FULL_SHARD over dp=2 (standing in for zero3", 2, 1),
        (make_layout("ddp", 4, tp=2, sequence_parallel=True), "DDP over dp=1 x TP2 (sequence parallel)", 1, 2),
    )
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    full = build_tiny_model(tiny_llama_config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, vocab_size=256)).num_parameters()
    results = calibrate_layouts_on_ranks(spec, workload, [c[0] for c in cases], ranks=2, layers=2, steps=2)
    for (_, described, dp, tp), result in zip(cases, results, strict=True):
        assert "calibrated on 2 gloo ranks with real collectives" in result.source, result.source
        assert described in result.source and "2-layer" in result.source
        assert (result.ranks, result.measured_tp) == (2, tp) and result.step_time_s > 0
        assert full // 2 <= result.local_parameters < full  # the layout was applied: rank 0 holds a shard
        assert result.efficiency == pytest.approx(efficiency_from(
            spec, workload, layers=2, tokens=32 * dp, step_time_s=result.step_time_s, peak_flops=result.peak_flops))
        req = PlanRequest(model=spec, gpu=gpu_spec("a100-80gb"), num_gpus=4, seq_len=16, global_batch=8,
                          base_efficiency=result.efficiency, efficiency_source=result.source)
        assert choose_layout(req).chosen.throughput.efficiency_source == result.source


def test_plan_cli_says_which_calibration_ran(tmp_path, capsys, monkeypatch):
    from hf_dist.cli import main

    spec_dir = tmp_path / "tiny"
    from hf_dist.models.tiny import tiny_llama_config

    tiny_llama_config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=256).save_pretrained(spec_dir)
    args = ["plan", "--model", str(spec_dir), "--gpus", "2", "--gpu", "a100-80gb", "--seq-len", "16",
            "--global-batch", "4", "--precision", "fp32", "--calibrate", "--calibrate-steps", "1"]
    assert main([*args, "--calibrate-ranks", "1", "--json"]) == 0
    captured = capsys.readouterr()
    source = json.loads(captured.out)["candidates"][0]["throughput"]["efficiency_source"]
    assert source.startswith("calibrated on one device (compute only; communication timed from its bytes; --calibrate-ranks 1)")
    assert "s/step, efficiency" in captured.err
    assert main([*args, "--calibrate-ranks", "0"]) == 2
    assert "--calibrate-ranks=0 must be positive" in capsys.readouterr().err
    # a failed multi-rank run is an error naming the one-device flag, not a silent switch to it
    from torch.multiprocessing.spawn import ProcessRaisedException

    from hf_dist.cli import calibrate_ranks

    def crash(*args, **kwargs):
        raise ProcessRaisedException("Traceback ...\nRuntimeError: gloo connect timed out", 1, 4242)

    monkeypatch.setattr(calibrate_ranks, "calibrate_on_ranks", crash)
    assert main([*args, "--calibrate-ranks", "2"]) == 3
    err = capsys.readouterr().err
    assert "the 2-rank calibration failed (RuntimeError: gloo connect timed out)" in err
    assert "--calibrate-ranks 1" in err

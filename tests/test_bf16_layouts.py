"""bf16 per layout on 2 gloo ranks (one spawn for every layout): each layout's error against one fp32 process is at
most ``FACTOR`` times one bf16 process's, and the step ledger's dtypes are the ones the planner forecasts.

The cases are ``tests/bf16_cases.py`` (``bench/bf16.py`` prints the same comparison as a table; docs/benchmarks.md).

Why ``FACTOR = 4``: bf16 keeps 8 significant bits, and a layout rounds at other points than one process does
(the order of a sum over ranks; FSDP2's and DeepSpeed's policies keep the residual stream and the weights in bf16
where one process under autocast keeps them fp32), so its error is another draw of the same rounding noise: the
same order, not the same value. Measured (bench/bf16.py, 11 layouts at 3 steps, 8 of them also at 5): ratios
0.88-2.6 for the losses, 0.85-1.7 for the parameter changes. A defect (a gradient not averaged, a lost aux-loss
term, a stale shard) is off by about an update: the largest fp32 parameter change is 1.2e-2 (Llama) and 1.7e-2
(Qwen3-MoE), 50-190 times the one-process bf16 error. 4 separates the two with room on both sides. The dtype half
keeps the comparison honest: a layout that silently trained in fp32 would pass the first half with an error near 0.
"""

from __future__ import annotations

import pytest

from bf16_cases import LAYOUTS
from dist_utils import run_distributed

FACTOR = 4.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from bf16_cases import ranks, references

    out = str(tmp_path_factory.mktemp("bf16"))
    refs = references(out, list(LAYOUTS))
    per_rank = run_distributed(ranks, 2, list(LAYOUTS), out, timeout_s=1800)
    return refs, per_rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_error_is_one_process_bf16_error(runs, layout):
    from bf16_cases import errors

    refs, per_rank = runs
    _, name, asked = LAYOUTS[layout]
    fp32, one = refs[(name, "fp32")], refs[(name, asked)]
    one_loss, one_param = errors(one, fp32)
    assert 0 < one_loss and 0 < one_param  # one process really computed in bf16: it differs from fp32
    for rank, result in enumerate(per_rank):
        loss, param = errors(result[layout], fp32)
        assert loss <= FACTOR * one_loss, f"rank {rank}: loss error {loss:.3g} > {FACTOR} x {one_loss:.3g}"
        assert param <= FACTOR * one_param, f"rank {rank}: parameter error {param:.3g} > {FACTOR} x {one_param:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dtypes_are_the_forecast(runs, layout):
    """Parameters, gradients, optimizer states, every matmul's operands (forward and backward) and each
    collective's payload are the dtypes of the preset ``precision_that_runs`` forecasts for the layout."""
    from bf16_cases import dtype_mismatches, forecast

    _, per_rank = runs
    for result in per_rank:
        preset, _ = forecast(layout, result[layout])
        assert preset != "fp32"
        assert dtype_mismatches(layout, result[layout]) == []


def test_the_presets_each_layout_runs(runs):
    from bf16_cases import forecast

    _, per_rank = runs
    presets = {layout: forecast(layout, per_rank[0][layout])[0] for layout in LAYOUTS}
    assert presets == {"ddp": "bf16_autocast", "ddp_pure": "pure_bf16", "fsdp2": "bf16_mixed",
                       "fsdp2_pure": "pure_bf16", "tp": "bf16_autocast", "tp_sp": "bf16_autocast",
                       "pp": "pure_bf16", "cp": "bf16_autocast", "ep_fsdp2": "bf16_mixed", "zero2": "bf16_mixed",
                       "zero3": "bf16_mixed"}


def test_fp32_reference_computes_in_fp32(runs):
    """The reference the errors are measured against has no bf16 in it (else every error would shrink)."""
    refs, _ = runs
    for (name, precision), run in refs.items():
        led = run["ledger"]
        dtypes = {d for phase in led["matmul_dtypes"].values() for d in phase} | set(led["param_dtypes"])
        assert (dtypes == {"float32"}) == (precision == "fp32"), (name, precision, dtypes)


def test_precision_record_rules():
    """Pure: the FSDP2 reduction stays fp32 in every bf16 preset; DeepSpeed has its own row; names are checked."""
    from hf_dist.planner.workload import make_layout
    from hf_dist.precision import PRECISION_DTYPES, tensor_dtypes

    ddp, fsdp, zero3 = (make_layout(s, 2) for s in ("ddp", "fsdp_full_shard", "zero3"))
    assert tensor_dtypes(ddp, "pure_bf16") == PRECISION_DTYPES["pure_bf16"]
    assert tensor_dtypes(fsdp, "pure_bf16").reduction == "float32"
    assert tensor_dtypes(fsdp, "pure_bf16").gathered == "bfloat16"
    assert tensor_dtypes(zero3, "bf16_mixed").parameters == "bfloat16"
    assert tensor_dtypes(zero3, "fp32") == PRECISION_DTYPES["fp32"]
    with pytest.raises(ValueError, match="precision='bf16' is not a preset"):
        tensor_dtypes(ddp, "bf16")


def test_deepspeed_master_starts_from_bf16_weights(runs):
    """What docs/layouts.md says: DeepSpeed casts the module to bf16 before it copies the fp32 master, so ZeRO's
    training starts from the rounded weights (its parameter errors are measured from there)."""
    import torch

    refs, per_rank = runs
    loaded = refs[("llama", "fp32")]["initial"]
    for layout in ("zero2", "zero3"):
        start = per_rank[0][layout]["initial"]
        assert any(not torch.equal(start[k], v) for k, v in loaded.items())
        for name, value in loaded.items():
            torch.testing.assert_close(start[name], value.bfloat16().float(), atol=0, rtol=0, msg=name)

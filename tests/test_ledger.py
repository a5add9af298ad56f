"""The step ledger's exact counts: collectives, bytes and FLOPs of one optimizer step per layout (2 gloo ranks, one
spawn for every layout), and the minimum's arithmetic (pure).

The counts are what ``bench/ledger.py`` prints (docs/benchmarks.md); a change to any layout's communication moves
them. Pins guard the fixes the ledger found: the Trainer's per-parameter gradient all-reduce hooks no longer run on
top of hf_dist's own reduction (CP reduced every gradient twice, in 22 calls; TP averaged its replicated gradients
in 6 more); under sequence parallelism the projections' input gradients leave each attention and MLP in one
reduce-scatter (were 5 all-reduces per block) and the norms' partial gradients in one all-reduce per step (were 11
small all-reduces, tensor by tensor in the optimizer step and the gradient norm).
"""

from __future__ import annotations

import dataclasses

import pytest

from dist_utils import run_distributed
from ledger_cases import STEPS

LAYOUTS = ["fsdp2", "tp", "tp_sp", "pp", "ep_fsdp2", "cp", "zero3"]  # ZeRO-3 last: it leaves accelerate's state
GRADS = 623_872
"""fp32 bytes of the tiny Llama's 155,968 parameters"""


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory):
    from ledger_cases import ranks

    per_rank = run_distributed(ranks, 2, LAYOUTS, str(tmp_path_factory.mktemp("ledger")))
    return {layout: [r[layout] for r in per_rank] for layout in LAYOUTS}


def _data(runs) -> dict[tuple[str, str], tuple[float, float]]:
    """(kind, dtype) -> (calls, bytes) per rank, averaged over ranks, of the calls of 1 KiB or more."""
    from hf_dist.metrics.ledger_minimum import measured_rows

    return {(r.kind, r.dtype): (r.count, r.bytes) for r in measured_rows([x["ledger"] for x in runs]) if not r.small}


EXPECTED = {
    # the embedding (65,536 B) is a unit of its own, gathered in forward and again in backward; the head (65,536 B), a
    # unit too, and the last block stay gathered from forward to backward: 6 gathers; each unit's gradients
    # reduce-scattered once. The root now holds the final norm alone (256 B), whose gather and reduce-scatter are
    # under 1 KiB (the small rows)
    "fsdp2": {("all_gather", "float32"): (6, 935_680 - 256), ("reduce_scatter", "float32"): (4, GRADS - 256)},
    # 4 forward + 5 backward activation all-reduces of 2 x 32 x 64 fp32 (per block one for attention's input, one
    # for the MLP's; one for the head's input); the logits gathered for the loss
    "tp": {("all_reduce", "float32"): (9, 9 * 16_384), ("all_gather", "float32"): (1, 65_536)},
    # sequence parallel: per block the attention and MLP inputs gathered and their outputs reduce-scattered, the
    # mirror in backward (2 x 32 x 64 fp32 each), + the head's input gathered (forward) and scattered (backward), the
    # whole embedding's input gradient gathered, the logits gathered; the 5 norms' partial gradients in one bucket
    "tp_sp": {("all_gather", "float32"): (11, 10 * 16_384 + 65_536), ("reduce_scatter", "float32"): (9, 9 * 16_384),
              ("all_reduce", "float32"): (1, 5 * 64 * 4)},
    # 2 micro-batches of 2 rows padded to 64 tokens x hidden 64, fp32
    "pp": {("send", "float32"): (2, 2 * 32_768), ("recv", "float32"): (2, 2 * 32_768)},
    # routed tokens (64 x top-3 x hidden 32, fp32) dispatched and combined per layer, forward and backward
    # (the head a unit of its own: the root's final norm, 128 B, moves to the small rows as under fsdp2)
    "ep_fsdp2": {("all_to_all", "float32"): (8, 8 * 24_576), ("all_gather", "float32"): (6, 137_792 - 128),
                 ("reduce_scatter", "float32"): (4, 91_904 - 128)},
    # DeepSpeed ZeRO-3 (ds_configs/zero3.json, HF's "auto" sizes for hidden 64): every parameter but the 5 norms
    # gathered once (kept gathered from forward to backward), in 14 calls; their gradients reduce-scattered once,
    # in buckets of hidden^2 = 4,096 elements (k and v together, every other tensor alone)
    "zero3": {("all_gather", "float32"): (14, GRADS - 5 * 256), ("reduce_scatter", "float32"): (14, GRADS - 5 * 256)},
    # q, k, v, out per layer both ways; every gradient in one bucket (+ one presence flag per parameter)
    "cp": {("all_to_all", "float32"): (16, 98_304), ("all_reduce", "float32"): (1, GRADS + 21 * 4)},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_communication_is_exact(ledgers, layout):
    assert _data(ledgers[layout]) == EXPECTED[layout]


FLOPS = {"fsdp2": (114_032_640, 1_048_576 - 262_144), "tp": (57_147_392, 524_288), "tp_sp": (57_147_392, 524_288),
         "ep_fsdp2": (25_362_432, 524_288 - 131_072), "cp": (57_081_856, 524_288 - 65_536)}
"""layout -> (executed FLOPs of the step over both ranks, above 6 N tokens + attention): the score matmul CPU flash
attention recomputes in backward (2 L s q_dim per token), less what the chunked loss skips (the lm_head of positions
without a label; TP computes whole logits)"""


@pytest.mark.parametrize("layout", list(FLOPS))
def test_executed_flops_are_exact(ledgers, layout):
    runs = ledgers[layout]
    executed, above = FLOPS[layout]
    assert sum(r["ledger"]["flops"] for r in runs) == executed
    assert executed - runs[0]["min_flops"] == above


def test_sequence_parallel_control_traffic(ledgers):
    """Before the norms' partial gradients were summed in one bucket, the optimizer step and the gradient norm each
    all-reduced them tensor by tensor: 11 small fp32 all-reduces per step, now the clipping norm's one."""
    from hf_dist.metrics.ledger_minimum import measured_rows

    small = {(r.kind, r.dtype): r.count for r in measured_rows([x["ledger"] for x in ledgers["tp_sp"]]) if r.small}
    assert small == {("all_reduce", "float32"): 1, ("all_reduce", "int32"): 1, ("all_gather", "int64"): 1}


def test_zero3_small_calls(ledgers):
    """ZeRO-3's calls under 1 KiB: the 5 norms (under stage3_param_persistence_threshold, whole on every rank)
    gathered again one by one after the step and their gradients reduce-scattered one by one; the gradient norm once
    per optimizer parameter group (decay, no decay) in float64."""
    from hf_dist.metrics.ledger_minimum import measured_rows

    small = {(r.kind, r.dtype): (r.count, r.bytes)
             for r in measured_rows([x["ledger"] for x in ledgers["zero3"]]) if r.small}
    assert small == {("all_gather", "float32"): (5, 5 * 256), ("reduce_scatter", "float32"): (5, 5 * 256),
                     ("all_reduce", "float64"): (2, 16), ("all_reduce", "int32"): (1, 4),
                     ("all_gather", "int64"): (1, 16)}


def test_dtypes_recorded(ledgers):
    for layout, runs in ledgers.items():
        ledger = runs[0]["ledger"]
        grads = {"float32"} if layout != "zero3" else set()  # ZeRO-3 keeps gradients in its partitions
        assert set(ledger["param_dtypes"]) == {"float32"} and set(ledger["grad_dtypes"]) == grads, layout
        assert ledger["loss_dtype"] == "float32", layout


def test_the_measured_step_is_the_last():
    assert STEPS >= 2  # attach_ledger measures from the end of the step before


def test_minimum_rows():
    from hf_dist.metrics.ledger_minimum import Row, StepShape, compare, minimum

    shape = StepShape(layers=2, hidden=64, q_dim=64, kv_dim=32, param_bytes=GRADS, units=3, tokens_per_micro=64)
    rows = {(m.kind, m.small): (m.count, m.bytes) for m in minimum("fsdp2", shape, dp=2)}
    assert rows == {("all_gather", False): (6, 2 * GRADS), ("reduce_scatter", False): (3, GRADS),
                    ("all_gather", True): (1, 16), ("all_reduce", True): (1, 4)}
    tp = minimum("tp", shape)
    assert [(m.kind, m.count, m.bytes) for m in tp] == [("all_reduce", 8, 8 * 64 * 64 * 4), ("all_reduce", 1, 4)]
    sp = minimum("tp_sp", dataclasses.replace(shape, sp_partial_bytes=1_280))
    assert [(m.kind, m.count, m.bytes, m.small) for m in sp] == [
        ("all_gather", 8, 8 * 64 * 64 * 4, False), ("reduce_scatter", 8, 8 * 64 * 64 * 4, False),
        ("all_reduce", 1, 1_280, False), ("all_reduce", 1, 4, True)]
    cp = {m.kind: (m.count, m.bytes) for m in minimum("cp", shape, cp=2)}
    assert cp["all_to_all"] == (16, 2 * 2 * (2 * 64 + 2 * 32) * 32 * 4)
    measured = [Row(kind="reduce_scatter", group="world/dp_shard", dtype="float32", small=False, count=3, bytes=GRADS,
                    minimum=None)]
    matched = compare(measured, minimum("fsdp2", shape, dp=2))
    assert matched[0].minimum.count == 3
    assert {r.kind for r in matched[1:]} == {"all_gather", "all_reduce"}  # minima never measured come last
    with pytest.raises(ValueError, match="no minimum for layout"):
        minimum("zero9", shape)

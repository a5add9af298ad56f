"""The planner's allocated peak against the allocator's own count, on CPU: one training step of a small Llama.

``hf_dist.planner.measure.allocated_peak`` reads the bytes the CPU allocator reports to the profiler at each
allocation; model states (parameters and AdamW's moments, after a first step) are added from the tensors
themselves. The planner (``estimate_memory``, one process, ``MemoryAssumptions(device="cpu")``: no allocator slack
or framework) must land within the band below in each case, which between them peak at every phase the planner
names: the end of forward (whole and chunked loss, bf16 autocast), the first and the last layer to run backward
(activation checkpointing), with and without gradient accumulation (the Trainer frees gradients after each optimizer
step: a forecast counting them at the end of forward was 16 % high in the first case).
"""

from __future__ import annotations

import pytest
import torch

from hf_dist.planner import MemoryAssumptions, Workload, estimate_memory, make_layout, model_spec
from hf_dist.planner.measure import allocated_peak, model_state_bytes

BAND = (-0.02, 0.06)
"""Forecast / measured - 1. Above 0 is conservative; the checkpointed last layer's set is counted whole (+5.5 %)."""
CASES = {  # name: (config fields, workload fields, the phase the forecast peaks in)
    "whole_loss": (dict(vocab_size=8192), dict(), "loss"),
    "chunked_loss": (dict(vocab_size=8192), dict(chunked_loss=True), "loss"),
    "bf16_autocast_chunked": (dict(vocab_size=8192), dict(precision="bf16_autocast", chunked_loss=True), "loss"),
    "checkpointed": (dict(vocab_size=8192), dict(activation_checkpointing=True), "loss"),
    "accumulation_2": (dict(vocab_size=8192), dict(gradient_accumulation_steps=2), "loss"),
    "wide_checkpointed": (dict(vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=4),
                          dict(activation_checkpointing=True), "backward_end"),
    "wide_checkpointed_accumulation_2": (
        dict(vocab_size=512, hidden_size=512, intermediate_size=1376, num_hidden_layers=4),
        dict(activation_checkpointing=True, gradient_accumulation_steps=2), "backward"),
}


def _measure(fields: dict, work: dict) -> tuple[int, object]:
    from hf_dist.loss.causal_lm import ChunkedCausalLMLoss
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(**{"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 688, **fields})
    model = build_tiny_model(config).train()
    workload = Workload(seq_len=256, micro_batch_size=2, attention="sdpa",
                        **{"precision": "fp32", "activation_checkpointing": False, **work})
    if workload.activation_checkpointing:
        model.gradient_checkpointing_enable()
    loss_fn = ChunkedCausalLMLoss(model) if workload.chunked_loss else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batches = [torch.randint(0, config.vocab_size, (2, 256)) for _ in range(workload.gradient_accumulation_steps)]

    def step():
        for ids in batches:
            with torch.autocast("cpu", torch.bfloat16, enabled=workload.precision == "bf16_autocast"):
                loss = loss_fn(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        model.zero_grad()  # what the Trainer does after each optimizer step (set_to_none)

    step()  # AdamW's moments exist from here on
    states = model_state_bytes(model, optimizer)
    assert states["gradients"] == 0
    measured = states["parameters"] + states["optimizer_states"] + allocated_peak(step)
    forecast = estimate_memory(model_spec(config), workload, make_layout("ddp", 1), MemoryAssumptions(device="cpu"))
    return measured, forecast


@pytest.mark.parametrize("case", list(CASES))
def test_the_forecast_peak_is_the_allocators(case):
    fields, work, phase = CASES[case]
    measured, forecast = _measure(fields, work)
    error = forecast.allocated / measured - 1
    assert BAND[0] <= error <= BAND[1], (case, measured, forecast.allocated, forecast.phase_totals)
    assert forecast.peak_phase == phase, forecast.phase_totals


def test_allocated_peak_counts_what_is_held_at_once():
    def hold_two_then_one():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1 << 20, dtype=torch.uint8)
        del a, b
        c = torch.empty(1 << 19, dtype=torch.uint8)
        del c

    assert allocated_peak(hold_two_then_one) == 2 << 20

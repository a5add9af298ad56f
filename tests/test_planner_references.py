"""The planner's terms against their references: DeepSpeed's own estimators, host RAM, the precision that runs.

Pure: DeepSpeed's ``estimate_zero2/3_model_states_mem_needs`` are called as functions (no engine, no process).
"""

from __future__ import annotations

import pytest

from hf_dist.planner import PlanRequest, Workload, choose_layout, estimate_memory, gpu_spec, make_layout, model_spec
from hf_dist.planner.host import host_memory
from hf_dist.precision import precision_that_runs
from hf_dist.strategy import Layout

BF16 = Workload(seq_len=2048, micro_batch_size=1, precision="bf16_mixed", activation_checkpointing=True)


def _largest_layer(model) -> int:
    return max(model.layer_params, model.embedding_params)


def test_zero2_model_states_match_deepspeeds_estimator():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = model_spec("llama-2-13b")
    b = estimate_memory(model, BF16, make_layout("zero2", 8))
    _, gpu = estimate_zero2_model_states_mem_needs(model.num_params, num_gpus_per_node=8, cpu_offload=False)
    # DeepSpeed: 2 B/param of bf16 parameters + 18 B/param / 8 (bf16 and fp32 gradients, master, Adam)
    ours = b.model_states + b.optimizer_step_temp
    assert abs(ours - gpu) / gpu < 0.01


@pytest.mark.parametrize("name, gpus", [("llama-2-13b", 8), ("llama-2-7b", 8)])
def test_zero3_optimizer_step_honours_sub_group_size_against_deepspeeds_estimator(name, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    model = model_spec(name)
    b = estimate_memory(model, BF16, make_layout("zero3", gpus))
    _, gpu, _ = estimate_zero3_model_states_mem_needs(model.num_params, _largest_layer(model),
                                                      num_gpus_per_node=gpus, cpu_offload=False)
    partition = -(-model.num_params // gpus)
    assert b.phase_totals["optimizer"] - b.comm_buffers == pytest.approx(
        16 * partition + 4 * min(partition, 10**9), rel=0.01)  # one fp32 sub-group of gradients at the step
    ours = b.model_states + b.optimizer_step_temp
    assert abs(ours - gpu) / gpu < 0.06  # 13B: -1.5 %; 7B: +5 % (DeepSpeed's flat 18 B/param + one layer)


@pytest.mark.parametrize("offload, per_param, kwargs", [
    ("cpu", 18, dict(cpu_offload=True, cpu_offload_params=True)),
    ("cpu_optimizer", 16, dict(cpu_offload=True, cpu_offload_params=False)),
])
def test_zero3_offload_host_ram_is_deepspeeds_18_or_16_bytes_times_1_5(offload, per_param, kwargs):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    model = model_spec("llama-2-7b")
    layout = make_layout("zero3", 16, offload=offload)  # two nodes of 8
    b = estimate_memory(model, BF16, layout)
    host = host_memory(model, BF16, layout, b)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(model.num_params, _largest_layer(model), num_gpus_per_node=8,
                                                        num_nodes=2, **kwargs)
    assert cpu == pytest.approx(per_param * model.num_params / 2 * 1.5, rel=1e-6)
    assert host.offload == pytest.approx(cpu, rel=0.002)  # per-tensor partition rounding
    assert host.peak == host.offload  # zero.Init loads a layer at a time: loading is far smaller
    if offload == "cpu_optimizer":  # parameters stay on the GPU: DeepSpeed's 2 B/param / N
        assert b.parameters == pytest.approx(2 * model.num_params / 16, rel=0.002)


def test_zero2_offload_host_ram_matches_deepspeed_on_one_node():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = model_spec("llama-2-7b")
    layout = make_layout("zero2", 4, offload="cpu")
    b = estimate_memory(model, BF16, layout)
    cpu, gpu = estimate_zero2_model_states_mem_needs(model.num_params, num_gpus_per_node=4, cpu_offload=True)
    assert host_memory(model, BF16, layout, b).offload == pytest.approx(cpu, rel=0.002)
    assert b.parameters == pytest.approx(gpu, rel=0.002) and b.gradients == b.optimizer_states == 0


def test_zero3_loading_is_deepspeeds_zero_init_estimate():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    model = model_spec("llama-2-13b")
    layout = make_layout("zero3", 8)
    host = host_memory(model, BF16, layout, estimate_memory(model, BF16, layout))
    cpu, _, _ = estimate_zero3_model_states_mem_needs(model.num_params, _largest_layer(model), num_gpus_per_node=8,
                                                      cpu_offload=False)
    assert host.loading == int(cpu)


def test_nvme_offload_only_where_deepspeed_honours_it():
    with pytest.raises(ValueError, match="NVMe .* only at ZeRO-3"):
        Layout(strategy="zero2", num_gpus=8, offload="nvme")
    Layout(strategy="zero3", num_gpus=8, offload="nvme")


def test_fsdp_reduce_scatter_input_is_fp32_beside_the_bf16_gradients():
    model = model_spec("llama-2-7b")
    b = estimate_memory(model, BF16, make_layout("fsdp_full_shard", 8))
    # FSDP2 copies the unit's bf16 gradients into an fp32 reduce-scatter buffer before freeing them; the untied lm_head
    # is a unit of its own, its gradient reduced after its backward
    assert b.unsharded_grads == (2 + 4) * model.layer_params


def test_pure_bf16_is_eight_bytes_per_parameter():
    model = model_spec("llama-2-7b")
    pure = Workload(seq_len=2048, precision="pure_bf16")
    b = estimate_memory(model, pure, make_layout("fsdp_full_shard", 8))
    assert b.parameters + b.gradients + b.optimizer_states == pytest.approx(8 * model.num_params / 8, rel=0.001)


@pytest.mark.parametrize("strategy, kwargs, expected", [
    ("fsdp_full_shard", {}, "bf16_mixed"), ("zero3", {}, "bf16_mixed"), ("ddp", {}, "bf16_autocast"),
    ("ddp", {"tp": 2}, "bf16_autocast"), ("fsdp_full_shard", {"pp": 2}, "pure_bf16"),
])
def test_each_layout_is_forecast_in_the_precision_it_runs(strategy, kwargs, expected):
    assert precision_that_runs(make_layout(strategy, 8, **kwargs), "bf16") == expected
    assert precision_that_runs(make_layout(strategy, 8, **kwargs), "fp32") == "fp32"


def test_eager_attention_counts_the_fp32_softmax_gradients():
    from hf_dist.planner.activations import activation_model

    model, layout = model_spec("llama-2-7b"), make_layout("ddp", 1)
    eager = activation_model(model, Workload(seq_len=4096, precision="bf16_mixed", attention="eager"), layout)
    sdpa = activation_model(model, Workload(seq_len=4096, precision="bf16_mixed", attention="sdpa"), layout)
    scores = model.num_attention_heads * 4096**2  # (b=1, heads, s, s)
    assert eager.grad_working_set - 2 * 2 * 4096 * model.hidden_size == 8 * scores
    assert sdpa.grad_working_set == 2 * 2 * 4096 * model.hidden_size + 2 * 2 * 4096 * model.intermediate_size


def test_host_ram_flags_offload_past_the_node_and_names_it():
    """Issue case: 70B on 8 x A100-80GB must not pick FSDP + CPU offload needing ~1.5 TiB without saying so."""
    plan = choose_layout(PlanRequest(model=model_spec("llama-2-70b"), gpu=gpu_spec("a100-80gb"), num_gpus=8,
                                     seq_len=4096, global_batch=64))
    fsdp_offload = next(c for c in plan.candidates if c.name == "fsdp_full_shard+offload_cpu")
    assert not fsdp_offload.fits and "host RAM" in fsdp_offload.reason
    assert plan.chosen.host.offload <= plan.request.host_ram
    one_l4 = choose_layout(PlanRequest(model=model_spec("llama-2-70b"), gpu=gpu_spec("l4"), num_gpus=1,
                                       seq_len=2048, global_batch=8))
    offload = next(c for c in one_l4.candidates if c.name == "zero3+offload_cpu")
    assert not offload.fits and "host RAM" in offload.reason and offload.host.offload > 2**40
    bigger = choose_layout(PlanRequest(model=model_spec("llama-2-70b"), gpu=gpu_spec("l4"), num_gpus=1,
                                       seq_len=2048, global_batch=8, host_ram_bytes=2 * 2**40))
    assert next(c for c in bigger.candidates if c.name == "zero3+offload_cpu").host.offload <= 2 * 2**40


def test_loading_defaults_to_what_hf_dist_from_pretrained_does_per_layout():
    """FSDP2/TP/PP stream each rank's slices (no whole-model warning for 70B on 8 GPUs); DDP and ZeRO-1/2 load with
    transformers on every rank; ZeRO-3 through zero.Init; ``every_rank``/``streaming`` still force either."""
    from hf_dist.strategy import streams_weights

    model = model_spec("llama-2-70b")
    plan = choose_layout(PlanRequest(model=model, gpu=gpu_spec("a100-80gb"), num_gpus=8, seq_len=4096,
                                     global_batch=64))
    assert plan.request.loading == "auto"
    by_name = {c.name: c for c in plan.candidates if c.host}
    fsdp, ddp = by_name["fsdp_full_shard"], by_name["ddp"]
    assert fsdp.host.loading == int(8 * 4 * (-(-model.num_params // 8) + _largest_layer(model)) * 1.5)
    assert "streaming (hf_dist.from_pretrained)" in fsdp.host.how_loaded and not fsdp.warnings
    assert ddp.host.loading == int(8 * 4 * model.num_params * 1.5) and "transformers" in ddp.host.how_loaded
    assert "only for FSDP2/TP/PP" in ddp.warnings[0]
    for c in by_name.values():
        assert c.layout.streaming_load == (c.layout.is_fsdp or c.layout.tp > 1 or c.layout.pp > 1)
    forced = choose_layout(PlanRequest(model=model, gpu=gpu_spec("a100-80gb"), num_gpus=8, seq_len=4096,
                                       global_batch=64, loading="every_rank"))
    fsdp_forced = next(c for c in forced.candidates if c.name == "fsdp_full_shard")
    assert fsdp_forced.host.loading == ddp.host.loading and "--loading auto" in fsdp_forced.warnings[0]
    # DDP x TP keeps half of the model per rank: streaming splits over tp x pp x FSDP shards, not the world
    # (fp32: bf16 training keeps an fp32 master, loaded as such)
    ddp_tp = make_layout("ddp", 8, tp=2)
    streamed = host_memory(model, BF16, ddp_tp, estimate_memory(model, BF16, ddp_tp))
    assert streamed.loading == int(8 * 4 * (-(-model.num_params // 2) + _largest_layer(model)) * 1.5)
    zero2 = make_layout("zero2", 8)
    forced_stream = host_memory(model, BF16, zero2, estimate_memory(model, BF16, zero2), loading="streaming")
    assert forced_stream.loading == int(8 * 4 * (model.num_params + _largest_layer(model)) * 1.5)
    assert not streams_weights(fsdp=False, tp=1, pp=1) and streams_weights(fsdp=False, tp=1, pp=2)
    with pytest.raises(ValueError, match="loading='lazy' is not known; use one of auto, every_rank, streaming"):
        host_memory(model, BF16, zero2, estimate_memory(model, BF16, zero2), loading="lazy")


def test_published_anchors_are_within_target():
    """bench/planner_anchors.py: every row (Harbor, torchtitan 7B and NeMo Qwen3-30B-A3B EP memory, MPT-13B and
    torchtitan 13B throughput)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "planner_anchors.py"
    spec = importlib.util.spec_from_file_location("planner_anchors", path)
    anchors = importlib.util.module_from_spec(spec)
    sys.modules["planner_anchors"] = anchors  # dataclasses look their module up
    spec.loader.exec_module(anchors)
    rows = anchors.memory_rows() + [row for row, _ in anchors.throughput_rows()]
    assert len(rows) == 6 and all(abs(row.error) <= row.target for row in rows), rows


def test_fsdp2_reduces_through_an_fp32_buffer_beside_bf16_gradients(tmp_path, monkeypatch):
    """The reference for ``states.py``: FSDP2 itself (one gloo rank), as hf_dist applies it with ``--bf16``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    seen = []
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in

    def record(unsharded_grads, reduce_scatter_input, world_size):
        seen.append(({g.dtype for g in unsharded_grads}, reduce_scatter_input.dtype,
                     sum(g.numel() for g in unsharded_grads), reduce_scatter_input.numel()))
        return copy_in(unsharded_grads, reduce_scatter_input, world_size)

    monkeypatch.setattr(_fsdp_collectives, "foreach_reduce_scatter_copy_in", record)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build_tiny_model(tiny_llama_config(hidden_size=64, num_hidden_layers=2, vocab_size=256))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        ids = torch.randint(0, 256, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        dist.destroy_process_group()
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    # per unit: bf16 gradients copied into an fp32 buffer of the same size, both alive during the copy
    assert {(frozenset(g), rs) for g, rs, _, _ in seen} == {(frozenset({torch.bfloat16}), torch.float32)}
    assert (layer_params, layer_params) in {(n, m) for _, _, n, m in seen}

"""Pure tests of the memory planner: catalogues, the Harbor check, the chooser, activations vs autograd, the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_dist.planner import (
    MemoryAssumptions,
    PlanRequest,
    Workload,
    choose_layout,
    estimate_memory,
    gpu_spec,
    make_layout,
    model_spec,
)
from hf_dist.planner.activations import activation_model
from hf_dist.planner.measure import SavedTensorBytes

HARBOR_PEAK_GB = 41
HARBOR = Workload(seq_len=4096, micro_batch_size=1, precision="bf16_mixed", attention="sdpa",
                  activation_checkpointing=True, gradient_accumulation_steps=8)


@pytest.mark.parametrize("name, params", [
    ("llama-2-7b", 6_738_415_616), ("llama-2-13b", 13_015_864_320), ("llama-2-70b", 68_976_648_192),
    ("llama-3-8b", 8_030_261_248), ("mistral-7b", 7_241_732_096), ("qwen2.5-7b", 7_615_616_512),
])
def test_catalogue_parameter_counts_match_published_models(name, params):
    assert model_spec(name).num_params == params


def test_model_spec_from_config_and_directory_matches_built_model(tmp_path):
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    config = tiny_llama_config(hidden_size=64, num_hidden_layers=2, vocab_size=256)
    config.save_pretrained(tmp_path)
    built = sum(p.numel() for p in build_tiny_model(config).parameters())
    assert model_spec(config).num_params == built
    assert model_spec(str(tmp_path)).num_params == built


def test_unknown_names_are_errors_that_list_the_choices():
    with pytest.raises(ValueError, match="llama-2-13b"):
        model_spec("llama-13b")
    with pytest.raises(ValueError, match="a100-80gb"):
        gpu_spec("a100")
    with pytest.raises(ValueError, match=r"does not compose with hf_dist's TP/PP; use FSDP2"):
        make_layout("zero2", 8, tp=2)


def test_harbor_fsdp_full_shard_lands_within_10_percent_of_41_gb():
    """The case study: Llama-2-13B, 8 x A100-80GB, FSDP FULL_SHARD wrapping decoder layers, seq 4096, micro 1,
    activation checkpointing, bf16, SDPA -- forecast in the precision hf_dist's FSDP2 runs with ``--bf16``
    (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), which ``precision_that_runs`` picks.

    What sits in memory at the peak (backward of the last layer), as the planner counts it:
      * fp32 parameter, gradient and Adam shards (the shards are the master): 16 B/8;
      * bf16 gathered units: the layer in backward, the one prefetched and the root (the final norm; the untied
        embedding and lm_head are units of their own, gathered only around their forward and backward);
      * the layer's bf16 unsharded gradient and its fp32 reduce-scatter input (lm_head's was reduced after its own
        backward);
      * 40 checkpointed bf16 layer inputs and the recomputed layer's saved set;
      * the caching allocator's slack over the transient bytes, 1 GiB of CUDA context + NCCL buffers.
    """
    from hf_dist.precision import precision_that_runs

    model, gpu = model_spec("llama-2-13b"), gpu_spec("a100-80gb")
    layout = make_layout("fsdp_full_shard", 8)
    assert precision_that_runs(layout, "bf16") == HARBOR.precision == "bf16_mixed"
    b = estimate_memory(model, HARBOR, layout)
    # within 10% of the case study's 41 GB in use (the issue's -16% for the old forecast is against 41e9 bytes)
    assert abs(b.total - HARBOR_PEAK_GB * 1e9) / (HARBOR_PEAK_GB * 1e9) < 0.10
    # the terms come from the model: fp32 shards of params/grads/Adam over 8 ranks...
    tensors = len(list(model.param_shapes()))
    assert b.parameters == b.gradients and b.optimizer_states == 2 * b.parameters + 4 * tensors
    assert b.parameters == 4 * sum(-(-s[0] // 8) * (s[1] if len(s) > 1 else 1) for _, s in model.param_shapes())
    # ...two bf16 decoder layers and the bf16 root (the final norm) gathered; one layer's bf16 gradient + fp32 reduce
    # input
    assert b.gathered_params == 2 * (2 * model.layer_params + model.hidden_size)
    assert b.unsharded_grads == (2 + 4) * model.layer_params
    # ...40 checkpointed bf16 layer inputs (plus the input ids) and one recomputed layer
    assert b.activations == 40 * 2 * 4096 * 5120 + 8 * 4096
    assert b.recomputed_layer == activation_model(model, HARBOR, layout).layer.total
    assert b.peak_phase == "backward" and b.allocated < b.reserved < b.total < b.fit_bytes < gpu.memory_bytes
    # the slack covers only the transient part: model states pack tightly
    assert b.allocator_slack == int(0.70 * (b.allocated - b.model_states))


def test_harbor_ddp_does_not_fit_and_says_by_how_much():
    plan = choose_layout(PlanRequest(model=model_spec("llama-2-13b"), gpu=gpu_spec("a100-80gb"), num_gpus=8,
                                     seq_len=4096, global_batch=64))
    ddp = plan.candidates[0]
    assert ddp.name == "ddp" and not ddp.fits
    assert ddp.memory.total > 3 * plan.request.gpu.memory_bytes
    assert "over by" in ddp.reason and f"{(ddp.memory.fit_bytes - plan.request.memory_limit) / 2**30:.1f}" in ddp.reason
    chosen = plan.chosen
    assert chosen is not None and chosen.fits and chosen.batch.gradient_accumulation_steps == 8
    # every candidate is rejected with its memory or a rule, or fits and says why it was not chosen
    for c in plan.candidates:
        assert c.reason
        assert c.chosen or "does not fit" in c.reason or "rule:" in c.reason or (
            c.fits and ("slower than" in c.reason or "within 5%" in c.reason))


def test_chooser_prefers_lora_when_asked_and_it_fits():
    plan = choose_layout(PlanRequest(model=model_spec("llama-2-70b"), gpu=gpu_spec("a100-80gb"), num_gpus=8,
                                     seq_len=4096, global_batch=64, lora=True))
    assert plan.chosen.layout.lora_rank == 16
    full = [c for c in plan.candidates if not c.layout.lora_rank and c.fits]
    assert full and all("--lora" in c.reason for c in full)


def test_batch_rule_rejects_layouts_with_a_fractional_accumulation():
    plan = choose_layout(PlanRequest(model=model_spec("llama-2-7b"), gpu=gpu_spec("a100-80gb"), num_gpus=8,
                                     seq_len=2048, global_batch=12))
    ddp = next(c for c in plan.candidates if c.name == "ddp")
    assert ddp.memory is None and "rule:" in ddp.reason and "global_batch_size=12" in ddp.reason


@pytest.mark.parametrize("attention, checkpointing, precision", [
    ("sdpa", False, "fp32"), ("eager", False, "fp32"), ("sdpa", True, "fp32"),
    ("sdpa", False, "bf16_autocast"), ("eager", False, "bf16_mixed"),
])
def test_predicted_activations_match_saved_tensor_bytes(attention, checkpointing, precision):
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    config = tiny_llama_config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=256)
    config._attn_implementation = attention
    model = build_tiny_model(config, dtype=torch.bfloat16 if precision == "bf16_mixed" else torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 256, (2, 32))
    with SavedTensorBytes(model) as saved, torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16_autocast"):
        model(input_ids=ids, labels=ids).loss.backward()
    workload = Workload(seq_len=32, micro_batch_size=2, precision=precision, attention=attention,
                        activation_checkpointing=checkpointing)
    predicted = activation_model(model_spec(config), workload, make_layout("ddp", 1)).saved_after_forward(
        layers=2, checkpointing=checkpointing)
    assert abs(predicted - saved.nbytes) <= 0.10 * saved.nbytes


def test_cpu_assumptions_drop_the_allowances():
    b = estimate_memory(model_spec("llama-2-7b"), HARBOR, make_layout("ddp", 2), MemoryAssumptions(device="cpu"))
    assert b.framework == 0 and b.allocator_slack == 0 and b.total == b.reserved == b.allocated


def test_plan_cli_json_plot_and_out(tmp_path, capsys):
    from hf_dist.cli import main

    args = ["plan", "--model", "llama-2-13b", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", "4096",
            "--global-batch", "64"]
    assert main([*args, "--json", "--plot", str(tmp_path / "mem.png"), "--out", str(tmp_path / "cfg")]) == 0
    data = json.loads(capsys.readouterr().out)
    chosen = next(c for c in data["candidates"] if c["chosen"])
    assert data["chosen"] == chosen["name"] and chosen["memory"]["fit_bytes"] <= data["memory_limit"]
    memory = chosen["memory"]
    assert memory["allocated"] < memory["reserved"] < memory["total"] and chosen["precision"] == "bf16_mixed"
    assert 0 < chosen["host_ram"]["peak"] <= data["host_ram"] and "assumed" in chosen["throughput"]["efficiency_source"]
    assert (tmp_path / "mem.png").read_bytes()[:4] == b"\x89PNG"
    written = {p.name for p in (tmp_path / "cfg").iterdir()}
    assert "accelerate.yaml" in written
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "alloc" in table and "resv" in table and "host" in table and "host RAM per node" in table
    assert main([*args, "--lora", "--out", str(tmp_path / "lora")]) == 0  # LoRA stays the script's
    assert "LoRA rank 16" in capsys.readouterr().err and (tmp_path / "lora" / "launch.sh").exists()
    # 63 is not a multiple of micro 2 x any data-parallel size: every layout is ruled out
    assert main([*args[:-2], "--global-batch", "63", "--micro-batch", "2"]) == 1
    assert main([*args[:2], "no-such-model", *args[3:]]) == 2


def test_tensor_and_sequence_parallel_split_what_they_shard():
    model = model_spec("llama-2-13b")
    plain = activation_model(model, HARBOR, make_layout("fsdp_full_shard", 8))
    tp = activation_model(model, HARBOR, make_layout("fsdp_full_shard", 8, tp=4, sequence_parallel=True))
    assert tp.layer.attention == plain.layer.attention // 4 and tp.layer.mlp == plain.layer.mlp // 4
    assert tp.layer.norms == plain.layer.norms // 4 and tp.checkpoint_input == plain.checkpoint_input // 4
    assert tp.layer.linear_inputs == plain.layer.linear_inputs  # column-parallel linears save the gathered input


def test_tp_splits_the_untied_head_and_its_autocast_copy_but_not_the_logits():
    from dataclasses import replace

    from hf_dist.planner.states import local_param_shapes

    model, work = model_spec("llama-2-13b"), replace(HARBOR, precision="bf16_autocast")
    layout = make_layout("fsdp_full_shard", 8, tp=4)
    shapes = dict(local_param_shapes(model, layout, layers=0, first=True, last=True))
    assert shapes["lm_head"] == (32000 // 4, 5120) and shapes["embed_tokens"] == (32000, 5120)
    plain, tp = activation_model(model, work, make_layout("fsdp_full_shard", 8)), activation_model(model, work, layout)
    assert plain.head - tp.head == 2 * 32000 * 5120 * 3 // 4  # the bf16 cast of the head's rank quarter
    assert tp.loss == plain.loss and tp.logits_forward == plain.logits_forward  # logits gathered whole
    odd = replace(model, vocab_size=32001)  # not divisible by tp: the head stays whole, as training keeps it
    assert dict(local_param_shapes(odd, layout, layers=0, first=True, last=True))["lm_head"] == (32001, 5120)


def test_pipeline_first_stage_holds_a_micro_batch_per_stage_in_flight():
    model, assume = model_spec("llama-2-13b"), MemoryAssumptions(device="cpu")
    layout = make_layout("fsdp_full_shard", 8, pp=4)
    b = estimate_memory(model, HARBOR, layout, assume)
    acts = activation_model(model, HARBOR, layout)
    assert b.stage == "first" and b.peak_phase == "backward"
    assert b.activations == 4 * (10 * acts.checkpoint_input + acts.embedding_ids)


def test_throughput_counts_six_flops_per_weight_plus_attention():
    from hf_dist.planner import estimate_throughput

    model = model_spec("llama-2-13b")
    layout = make_layout("fsdp_full_shard", 8)
    t = estimate_throughput(model, HARBOR, layout, gpu_spec("a100-80gb"))
    weights = model.num_hidden_layers * model.layer_linear_weights + model.lm_head_params
    attention = 12 * model.num_hidden_layers * 4096 * model.q_dim
    assert t.model_flops_per_token == 6 * weights + attention
    assert t.executed_flops_per_token == t.model_flops_per_token + 2 * weights + attention / 3
    tokens = 64 * 4096
    assert t.tokens_per_s == pytest.approx(tokens / t.step_time_s)
    comm = t.communication  # FSDP2's gathers and reduce-scatters overlap compute
    assert comm.exposed_s == 0 and t.step_time_s == max(t.compute_s, comm.overlappable_s)
    assert t.mfu == pytest.approx(t.efficiency * t.model_flops_per_token / t.executed_flops_per_token
                                  * t.compute_s / t.step_time_s)
    assert t.wall_clock_s(1e9) == pytest.approx(1e9 / t.tokens_per_s)


@pytest.mark.parametrize("name", ["llama-2-13b", "qwen2.5-7b", "mistral-7b", "llama-3.2-1b"])
def test_catalogue_entries_round_trip_through_pretrained_config(name):
    from hf_dist.planner.catalogue import get_model_config

    config = get_model_config(name)
    assert config.model_type == model_spec(name).model_type
    assert model_spec(config).num_params == model_spec(name).num_params


def test_peak_rss_of_a_started_process_is_its_own_not_its_parents():
    """``peak_rss_bytes`` in a process started from a big one reads that process's own peak: ``ru_maxrss`` would carry
    the parent's over ``execve`` (every spawned rank of a bench reported at least its parent's RSS)."""
    import os
    import subprocess
    import sys

    from hf_dist.planner.measure import peak_rss_bytes

    ballast = torch.ones(256 * 2**20 // 4)  # 256 MiB touched in this process before the child starts
    code = "from hf_dist.planner.measure import peak_rss_bytes; print(peak_rss_bytes())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                               env=env).stdout.split()[-1])
    assert float(ballast[-1]) == 1.0
    assert child < peak_rss_bytes() - 200 * 2**20, (child, peak_rss_bytes())


@pytest.mark.parametrize("accumulation, expected", [(1, [False, False]), (2, [False, True, False, True])])
def test_gradients_exist_in_forward_only_where_the_forecast_counts_them(tmp_path, accumulation, expected):
    """The Trainer frees the gradients after each optimizer step (``zero_grad`` sets them to None): a forward sees
    them only after an earlier micro-step of the same step. The forecast's loss phase counts them likewise under
    DDP; under FSDP they stay counted (``planner.memory.gradients_kept``)."""
    from transformers import Trainer, TrainingArguments

    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config
    from hf_dist.planner.memory import gradients_kept
    from trainer_harness import token_dataset

    model = build_tiny_model(tiny_llama_config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=256))
    seen = []
    model.register_forward_pre_hook(lambda m, _: seen.append(any(p.grad is not None for p in m.parameters())))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, use_cpu=True, report_to=[],
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=token_dataset(16)).train()
    assert seen == expected

    spec = model_spec("llama-2-7b")
    workload = Workload(seq_len=4096, micro_batch_size=1, precision="bf16_autocast",
                        gradient_accumulation_steps=accumulation)
    for strategy, counted in (("ddp", accumulation > 1), ("fsdp_full_shard", True)):
        layout = make_layout(strategy, 2)
        with_grads = estimate_memory(spec, dataclasses.replace(workload, gradient_accumulation_steps=2), layout)
        b = estimate_memory(spec, workload, layout)
        assert gradients_kept(workload, layout) == counted
        gap = with_grads.phase_totals["loss"] - b.phase_totals["loss"]
        assert gap == (0 if counted else with_grads.gradients), (strategy, gap)
        assert ("backward_end" in b.phase_totals) == (not counted)

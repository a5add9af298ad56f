"""``hf-dist plan --trainer dpo|grpo``: the frozen reference model, DPO's pairs, GRPO's generation buffers, and only
the layouts the TRL trainers run. Pure: no process group."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hf_dist.planner import PlanRequest, Workload, choose_layout, estimate_memory, gpu_spec, model_spec
from hf_dist.planner.catalogue import ModelSpec
from hf_dist.planner.memory import MemoryAssumptions, kv_cache_bytes, reference_bytes
from hf_dist.planner.states import model_states
from hf_dist.strategy import Layout

TINY = ModelSpec(name="tiny", model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=256)
FSDP2 = Layout(strategy="fsdp_full_shard", num_gpus=2)
CPU = MemoryAssumptions(device="cpu")


def _request(**kwargs) -> PlanRequest:
    base = dict(model=TINY, gpu=gpu_spec("h100"), num_gpus=2, seq_len=32, global_batch=8, precision="fp32")
    return PlanRequest(**{**base, **kwargs})


def _candidate(plan, name):
    return next(c for c in plan.candidates if c.name == name)


def test_the_dpo_reference_is_the_policys_parameters_sharded_alike():
    """TINY's fp32 parameter shards on 2 FSDP2 ranks: embedding 128 x 64 + per layer (q 32x64, k and v 16x64, o 32x64,
    gate and up 64x64, down 32x128, two norms 32) 18,496 x 2 + norm 32 + lm_head 128 x 64 = 53,408 elements,
    213,632 bytes. The DPO reference holds exactly that, no gradients or Adam; under LoRA nothing."""
    sft, dpo = choose_layout(_request()), choose_layout(_request(trainer="dpo"))
    work = Workload(seq_len=32, precision="fp32", reference_model=True)
    assert reference_bytes(TINY, work, FSDP2, layers=2, first=True, last=True) == 213_632
    assert model_states(TINY, work, FSDP2, layers=2).parameters == 213_632
    plain, ref = _candidate(sft, "fsdp_full_shard").memory, _candidate(dpo, "fsdp_full_shard").memory
    assert plain.reference_model == 0 and ref.reference_model == 213_632
    assert (ref.gradients, ref.optimizer_states) == (plain.gradients, plain.optimizer_states)  # the policy's only
    lora = reference_bytes(TINY, work, dataclasses.replace(FSDP2, lora_rank=8), layers=2, first=True, last=True)
    assert lora == 0  # the adapter-disabled policy
    ddp = reference_bytes(TINY, work, Layout(strategy="ddp", num_gpus=2), layers=2, first=True, last=True)
    assert ddp == 4 * TINY.num_params  # a whole replica per rank under DDP


def test_dpo_runs_chosen_and_rejected_in_one_forward():
    """A micro batch of 1 pair is a forward of 2 sequences: the activations of an SFT micro batch of 2 (TRL's fused
    LM head: no N x V logits, counted as the chunked loss), plus the reference; FLOPs add the reference's forward."""
    dpo = _candidate(choose_layout(_request(trainer="dpo")), "fsdp_full_shard")
    assert dpo.batch.micro_batch_size == 1
    sft2 = estimate_memory(TINY, Workload(seq_len=32, micro_batch_size=2, precision="fp32", chunked_loss=True,
                                          gradient_accumulation_steps=dpo.batch.gradient_accumulation_steps,
                                          head_unit=False), FSDP2)  # TRL's head stays in FSDP's root
    assert dpo.memory.activations == sft2.activations and dpo.memory.logits == sft2.logits
    assert dpo.memory.allocated == sft2.allocated + 213_632
    sft = _candidate(choose_layout(_request()), "fsdp_full_shard").throughput
    # per token: 6P + 12 L s q_dim = 589,824 trained (P = 90,112, q_dim 64); a forward is 2P + 4 L s q_dim = 196,608,
    # run again by activation checkpointing, and by the reference (executed, not in the MFU's model FLOPs)
    assert sft.model_flops_per_token == dpo.throughput.model_flops_per_token == 589_824
    assert sft.executed_flops_per_token == 589_824 + 196_608
    assert dpo.throughput.executed_flops_per_token == 589_824 + 2 * 196_608


def test_grpo_holds_the_kv_cache_of_the_completions_it_generates():
    """Global batch 8 completions on 2 ranks, micro 1: accumulation 4, so one generation batch (the global batch) is
    4 sequences per rank at once; their fp32 keys and values: 2 x 2 layers x kv_dim 32 x 4 bytes x 4 x 32 tokens =
    65,536 bytes. The generation phase holds the states, the units a forward gathers and the cache."""
    plan = choose_layout(_request(trainer="grpo", num_generations=4))
    c = _candidate(plan, "fsdp_full_shard")
    work = Workload(seq_len=32, precision="fp32", generation_sequences=4, head_unit=False)  # TRL: head in the root
    assert kv_cache_bytes(TINY, work, FSDP2, layers=2) == 65_536
    states = model_states(TINY, work, FSDP2, layers=2)
    generation = c.memory.phase_totals["generation"]
    assert generation == (states.parameters + states.gradients + states.optimizer_states
                          + states.gathered_in_backward + 65_536)
    assert c.memory.reference_model == 0  # TRL's default beta = 0: no reference model
    with_ref = _candidate(choose_layout(_request(trainer="grpo", num_generations=4, beta=0.04)), "fsdp_full_shard")
    assert with_ref.memory.phase_totals["generation"] == generation + 213_632
    # the cache can be the peak: 64 completions of 4,096 tokens on one H100 do not fit beside an 8B policy's states
    big = estimate_memory(model_spec("llama-3-8b"), Workload(seq_len=4096, precision="bf16_mixed",
                                                             generation_sequences=64, chunked_loss=True),
                          Layout(strategy="fsdp_full_shard", num_gpus=8), CPU)
    assert big.peak_phase == "generation" and big.generation_cache == 2 * 32 * 1024 * 2 * 64 * 4096


def test_trl_trainers_are_offered_only_the_layouts_they_run():
    for trainer in ("dpo", "grpo"):
        plan = choose_layout(_request(trainer=trainer, global_batch=8, num_gpus=4, model=model_spec("llama-3-8b"),
                                      gpu=gpu_spec("h100"), seq_len=1024, precision="bf16"))
        offered = {c.layout.strategy for c in plan.candidates if c.memory is not None}
        assert offered <= {"ddp", "fsdp_full_shard", "fsdp_shard_grad_op"}, offered
        assert all(c.layout.tp == c.layout.cp == 1 for c in plan.candidates if c.memory is not None)
        # DPO runs PP with every rank in one pipeline (FSDP2 over one dp rank shards nothing); GRPO no PP
        assert {(c.layout.pp, c.layout.dp) for c in plan.candidates if c.memory is not None and c.layout.pp > 1} <= \
            ({(4, 1)} if trainer == "dpo" else set())
        zero3 = _candidate(plan, "zero3")
        assert zero3.memory is None and zero3.reason.startswith("rule: DeepSpeed zero3 with Dist")
        assert plan.chosen is not None


def test_sft_is_unchanged_and_grpo_batches_hold_whole_groups():
    sft = _candidate(choose_layout(_request()), "fsdp_full_shard")
    plain = estimate_memory(TINY, Workload(seq_len=32, precision="fp32", chunked_loss=True,
                                           gradient_accumulation_steps=4), FSDP2)
    assert sft.memory.allocated == plain.allocated and "generation" not in sft.memory.phase_totals
    with pytest.raises(ValueError, match=r"global_batch=12 counts GRPO completions .* use global_batch in \[8, 16\]"):
        _request(trainer="grpo", global_batch=12)
    with pytest.raises(ValueError, match="trainer='ppo' is not known"):
        _request(trainer="ppo")


def test_grpo_defaults_are_trls():
    from trl import GRPOConfig

    from hf_dist.planner.chooser import GRPO_DEFAULTS

    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {k: defaults[k] for k in GRPO_DEFAULTS} == GRPO_DEFAULTS


def test_plan_cli_trainer(capsys):
    from hf_dist.cli import main

    args = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "2048",
            "--global-batch", "64"]
    assert main([*args, "--trainer", "grpo", "--beta", "0.04", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trainer"] == "grpo" and data["reference_model"] and data["num_generations"] == 8
    chosen = next(c for c in data["candidates"] if c["chosen"])
    assert chosen["memory"]["reference_model"] > 0 and chosen["strategy"].startswith("fsdp")
    assert main([*args, "--trainer", "dpo"]) == 0
    assert "trainer dpo: micro batch 1 pairs = 2 sequences per forward" in capsys.readouterr().out
    assert main([*args, "--num-generations", "4"]) == 2
    assert "--num-generations applies to --trainer grpo only" in capsys.readouterr().err


def test_trls_trainers_keep_the_head_in_fsdps_root_and_the_plan_counts_it_through_backward():
    """DistTrainer makes an untied head an FSDP2 unit of its own; TRL's trainers keep it in the root (their fused LM
    head reads its weight), so from its backward on the root holds its whole weight and its unsharded gradient too
    (``tests/test_planner_peak_dist.py`` measures the head-in-root layout's peak at the end of forward)."""
    from hf_dist.batch import BatchContract
    from hf_dist.planner.chooser import _workload

    batch = BatchContract(world_size=2, global_batch_size=8, micro_batch_size=1)
    assert [_workload(_request(trainer=t), FSDP2, batch).head_unit for t in ("sft", "dpo", "grpo")] == [
        True, False, False]
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    as_unit = estimate_memory(untied, Workload(seq_len=32, precision="fp32", activation_checkpointing=False), FSDP2, CPU)
    in_root = estimate_memory(untied, Workload(seq_len=32, precision="fp32", activation_checkpointing=False,
                                               head_unit=False), FSDP2, CPU)
    head = 4 * untied.vocab_size * untied.hidden_size  # fp32, whole
    assert in_root.phase_totals["backward"] - as_unit.phase_totals["backward"] == 2 * head

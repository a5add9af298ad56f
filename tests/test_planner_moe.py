"""The planner's model of a mixture of experts: parameters (total and active), expert states over ``ep x efsdp``,
routed-token activations, FLOPs on active parameters, and the chooser's EP proposal. Pure: no process group."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_dist.planner import PlanRequest, Workload, choose_layout, estimate_memory, gpu_spec, make_layout, model_spec
from hf_dist.planner.activations import activation_model
from hf_dist.planner.catalogue import spec_config
from hf_dist.planner.flops import module_flop_counts
from hf_dist.planner.states import model_states
from hf_dist.planner.throughput import flop_counts

PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "mixtral-8x7b")


def _small(name: str):
    """The preset scaled down, every MoE field kept non-default (top-k, expert width, gpt-oss biases and sinks)."""
    spec = model_spec(name)
    return replace(spec, num_hidden_layers=2, hidden_size=64, head_dim=16, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, num_experts=8, experts_per_token=3,
                   moe_intermediate_size=24, intermediate_size=40 if spec.model_type == "qwen3_moe" else 24)


@pytest.mark.parametrize("name", PRESETS)
def test_spec_parameters_and_active_flops_equal_the_model_transformers_builds(name):
    spec = _small(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec_config(spec))
    names = dict(model.named_parameters())
    assert sum(p.numel() for p in names.values()) == spec.num_params
    experts = [p for n, p in names.items() if ".experts." in n and p.ndim == 3]
    assert experts and all(p.shape[0] == spec.num_experts for p in experts)
    # the runtime MFU (a live module) and the forecast count the same active matmul weights: k of E experts
    assert module_flop_counts(model).trainable_matmul == flop_counts(spec).trainable_matmul
    idle = sum(p.numel() for p in experts) * (8 - 3) // 8  # the experts a token is not routed to
    assert spec.num_active_params == spec.num_params - idle


def test_published_total_and_active_parameter_counts():
    billions = {n: (round(model_spec(n).num_params / 1e9, 1), round(model_spec(n).num_active_params / 1e9, 1))
                for n in PRESETS}
    # model cards: Qwen3-30B-A3B 30.5B total / 3.3B active (3.35B); Mixtral-8x7B 46.7B / 12.9B; gpt-oss-20b 20.9B total
    assert billions["qwen3-30b-a3b"] == (30.5, 3.4) and billions["mixtral-8x7b"] == (46.7, 12.9)
    assert billions["gpt-oss-20b"][0] == 20.9
    # Qwen3-235B-A22B: 235B total / 22B active; gpt-oss-120b: 116.8B total (its card's 5.1B active leaves the input
    # embedding out, like gpt-oss-20b's: only totals are compared for gpt-oss)
    assert billions["qwen3-235b-a22b"] == (235.1, 22.2) and billions["gpt-oss-120b"][0] == 116.8


def _expected_params(spec, layout, bytes_per: int) -> int:
    """Parameter bytes of rank 0: dense tensors FSDP2-sharded on dim 0 over dp (DDP: whole), the rank's E / ep
    experts over efsdp (DDP: whole)."""
    fsdp = layout.is_fsdp
    total = 0
    for name, shape in spec.param_shapes():
        if ".mlp.experts." in name:
            rows, shards = shape[0] // layout.ep, layout.efsdp if fsdp else 1
        else:
            rows, shards = shape[0], layout.dp if fsdp else 1
        total += math.ceil(rows / shards) * math.prod(shape[1:])
    return bytes_per * total


@pytest.mark.parametrize("strategy,ep", [("fsdp_full_shard", 8), ("fsdp_full_shard", 2), ("fsdp_full_shard", 1),
                                         ("ddp", 4)])
def test_expert_states_are_divided_over_ep_and_efsdp_dense_over_dp(strategy, ep):
    spec = model_spec("qwen3-30b-a3b")
    layout = make_layout(strategy, 8, ep=ep)
    states = model_states(spec, Workload(seq_len=4096, precision="pure_bf16"), layout,
                          layers=spec.num_hidden_layers)
    expected = _expected_params(spec, layout, 2)
    assert states.parameters == expected and states.gradients == expected
    assert states.optimizer_states == 2 * expected + 4 * len(list(spec.param_shapes()))
    if strategy == "fsdp_full_shard":  # a layer's experts gathered: E / ep of them (efsdp shards each)
        per_layer = sum(math.prod(s) for _, s in spec.expert_param_shapes()) // ep
        dense_unit = sum(math.prod(s) for n, s in spec.layer_param_shapes() if not n.startswith("mlp.experts."))
        # the layer in backward and the one prefetched (by the first layer: the untied embedding's own unit), and
        # the root (the final norm); under EP the experts are units of their own, beside each layer's dense unit
        if ep > 1:
            dense = dense_unit + max(dense_unit, spec.embedding_params)
            assert states.gathered_in_backward == 2 * (dense + 2 * per_layer + spec.hidden_size)
        else:
            unit = per_layer + dense_unit
            assert states.gathered_in_backward == 2 * (unit + max(unit, spec.embedding_params) + spec.hidden_size)


def test_routed_tokens_and_the_exchange_buffers_count_in_activations():
    spec = model_spec("qwen3-30b-a3b")
    work = Workload(seq_len=4096, precision="bf16_mixed")
    n, h, k = work.tokens, spec.hidden_size, spec.experts_per_token
    plain = activation_model(spec, work, make_layout("fsdp_full_shard", 8))
    ep = activation_model(spec, work, make_layout("fsdp_full_shard", 8, ep=8))
    assert ep.grad_working_set - plain.grad_working_set == 2 * 2 * n * k * h  # send + receive, bf16
    routed = 2 * n * k * (2 * h + 4 * spec.moe_intermediate_size)
    router = 4 * n * spec.num_experts + 2 * n * spec.num_experts + (32 + 2) * n * k + 4 * spec.num_experts
    assert plain.layer.mlp == routed + router
    assert plain.largest_layer_tensor == 2 * n * k * 2 * spec.moe_intermediate_size  # the gate_up output


def test_expert_parallelism_lowers_memory_and_the_chooser_proposes_it():
    spec = model_spec("qwen3-30b-a3b")
    work = Workload(seq_len=4096, precision="bf16_mixed", chunked_loss=True)
    totals = {ep: estimate_memory(spec, work, make_layout("fsdp_full_shard", 8, ep=ep)).total for ep in (1, 2, 8)}
    assert totals[1] > totals[2] > totals[8]
    plan = choose_layout(PlanRequest(model=spec, gpu=gpu_spec("h100-80gb"), num_gpus=8, seq_len=4096,
                                     global_batch=8))
    chosen = plan.chosen
    # EP2's expert gathers hide behind compute and its all-to-all sends 1/2 of the routed tokens (EP8: 7/8)
    assert chosen is not None and chosen.layout.name == "fsdp_full_shard+ep2" and chosen.memory.total == totals[2]
    ep8 = next(c for c in plan.candidates if c.layout.name == "fsdp_full_shard+ep8")
    assert ep8.fits and "slower than fsdp_full_shard+ep2" in ep8.reason
    plain = next(c for c in plan.candidates if c.layout.name == "fsdp_full_shard")
    assert not plain.fits  # without EP the same model does not fit the limit
    assert all(c.layout.strategy in ("fsdp_full_shard", "ddp") for c in plan.candidates if c.layout.ep > 1)


@pytest.mark.parametrize("name,lora", [("qwen3-30b-a3b", False), ("gpt-oss-20b", False), ("mixtral-8x7b", True)])
def test_every_preset_is_planned_with_ep_layouts_that_fit(name, lora):
    """Mixtral-8x7B's full fine-tune does not fit 8 H100s without offload (46.7B x 16 bytes); with LoRA it does. Each
    EP layout that fits is timed with its all-to-all; the choice is the fastest (gpt-oss-20b: ZeRO-3, whose bf16
    gathers and reduce-scatters hide behind compute while EP's token exchange cannot)."""
    plan = choose_layout(PlanRequest(model=model_spec(name), gpu=gpu_spec("h100"), num_gpus=8, seq_len=4096,
                                     global_batch=8, lora=lora))
    eps = [c for c in plan.candidates if c.layout.ep == 8 and c.fits]
    assert eps, [(c.name, c.reason) for c in plan.candidates]
    assert all("all_to_all" in {r.kind for r in c.throughput.communication.rows} for c in eps)
    assert plan.chosen is not None and bool(plan.chosen.layout.lora_rank) == lora
    assert plan.chosen.name == {"qwen3-30b-a3b": "fsdp_full_shard+ep2", "gpt-oss-20b": "zero3",
                                "mixtral-8x7b": "ddp+ep8+lora16"}[name]


def test_fsdp2_cannot_split_fewer_experts_than_its_ranks():
    """FSDP2 shards on dim 0: Mixtral's 8 experts over 16 ranks leave half the ranks padding, and under EP 8 the
    one expert per rank is not split over efsdp = 2 at all -- the planner counts what FSDP2 allocates."""
    spec = model_spec("mixtral-8x7b")
    work = Workload(seq_len=4096, precision="bf16_mixed")
    states = model_states(spec, work, make_layout("fsdp_full_shard", 16, ep=8), layers=spec.num_hidden_layers)
    expert = sum(math.prod(s) for _, s in spec.expert_param_shapes()) // 8 * spec.num_hidden_layers
    assert states.parameters >= 4 * expert  # one whole expert per layer on every rank
    assert states.parameters == _expected_params(spec, make_layout("fsdp_full_shard", 16, ep=8), 4)


def test_dense_models_get_no_ep_layouts():
    plan = choose_layout(PlanRequest(model=model_spec("llama-3-8b"), gpu=gpu_spec("h100"), num_gpus=8,
                                     seq_len=2048, global_batch=16))
    assert all(c.layout.ep == 1 for c in plan.candidates)


def test_plan_cli_writes_the_ep_layout(tmp_path, capsys):
    from hf_dist.cli import main as cli_main

    out = tmp_path / "cfg"
    assert cli_main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "4096",
                     "--global-batch", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen: fsdp_full_shard+ep2" in text and "optimizer_states" in text
    assert "--ep_size 2" in (out / "launch.sh").read_text()


def test_expert_parallelism_is_offered_beside_tp_pp_and_cp_and_sized():
    """EP x TP, EP x PP and EP x CP are candidates (the layouts the registry proves for qwen3_moe), each with its own
    memory: on 4 x 8 GPUs at 32k tokens a 235B MoE fits with LoRA under EP x CP, and EP over each pipeline stage
    holds fewer bytes than the stage without EP."""
    plan = choose_layout(PlanRequest(model=model_spec("qwen3-235b-a22b"), gpu=gpu_spec("h100-80gb"), num_gpus=8,
                                     num_nodes=4, seq_len=32768, global_batch=32, lora=True))
    by_name = {c.name: c for c in plan.candidates}
    for name in ("fsdp_full_shard+tp2+ep4", "fsdp_full_shard+pp4+ep8", "fsdp_full_shard+ep8+cp2+lora16"):
        assert by_name[name].memory is not None, by_name[name].reason
    assert by_name["fsdp_full_shard+ep8+cp2+lora16"].fits
    assert by_name["fsdp_full_shard+pp4+ep8"].memory.total < by_name["fsdp_full_shard+pp4"].memory.total
    assert plan.chosen is not None


def test_one_hf_qwen3_moe_layer_saves_the_planned_bytes():
    """transformers' own Qwen3-MoE layer (its experts forward, bf16 as FSDP2 computes it) against ``_layer``."""
    from hf_dist.planner.measure import SavedTensorBytes
    from hf_dist.models.tiny import build_tiny_model

    spec = replace(_small("qwen3-30b-a3b"), num_hidden_layers=1)
    b, s = 2, 32
    config = spec_config(spec)
    config._attn_implementation = "sdpa"
    model = build_tiny_model(config, dtype=torch.bfloat16).train()
    layer = model.model.layers[0]
    hidden = torch.randn(b, s, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(s)[None].expand(b, s)
    cos, sin = model.model.rotary_emb(hidden, positions)
    with SavedTensorBytes(layer) as saved:
        layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    rope = cos.numel() * cos.element_size() + sin.numel() * sin.element_size()  # the planner's rope_tables term
    planned = activation_model(spec, Workload(seq_len=s, micro_batch_size=b, precision="bf16_mixed"),
                               make_layout("fsdp_full_shard", 1)).layer.total
    assert abs(saved.nbytes - rope - planned) <= 0.01 * planned, (saved.nbytes - rope, planned)


def test_plan_command_without_workload_proposes_ep_and_says_what_it_assumed(capsys):
    from hf_dist.cli import main as cli_main

    assert cli_main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-80gb"]) == 0
    out, err = capsys.readouterr()
    assert "assumed --seq-len 4096, --global-batch 8" in err
    chosen = [line for line in out.splitlines() if line.startswith(" *")]
    assert len(chosen) == 1 and "+ep" in chosen[0], out

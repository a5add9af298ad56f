"""Pipeline parallelism against one process (fp32, gloo, CPU): every schedule, PP x DP, LoRA, save and eval.

One spawned group per world size runs every variant, to pay the start-up cost once.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from pp_harness import (
    HIDDEN, LAYERS, SEQ, VOCAB, batches, padded_batch, pipelined_run, portable, reference_run, tiny_model, tiny_phi3,
)

SCHEDULE_MICROBATCHES = {"gpipe": 4, "1f1b": 4, "interleaved_1f1b": 8, "interleaved_zb": 8, "zbv": 8}
GLOBAL_BATCH = 8


def _lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tiny_model()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(1)  # LoRA B starts at zero: give it values so the adapter's every tensor is checked
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return peft_model


def _two_ranks(rank, world_size, out_dir):
    """Every schedule, then tied embeddings, then LoRA, then OPT, in one 2-rank group (pp=2)."""
    results = _schedules(out_dir)
    results["tied"] = _tied(os.path.join(out_dir, "tied"))
    results["lora"] = _lora(os.path.join(out_dir, "adapter"))
    results["opt"] = _opt()
    return results


TIED_SCHEDULES = {"1f1b": 4, "zbv": 8}  # copies on two ranks (gradients summed); both on rank 0 (shared)


def _tied(out_dir):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, gather_state_dict, save_pretrained

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    results = {}
    for schedule, microbatches in TIED_SCHEDULES.items():
        config = PipelineConfig(schedule=schedule, microbatches=microbatches)
        pipe = PipelinedCausalLM(tiny_model(tie_word_embeddings=True), dims=dims, config=config)
        losses, norms = pipelined_run(pipe, batches(GLOBAL_BATCH), dp_rank=0, dp=1)
        results[schedule] = {"losses": losses, "norms": norms, "state": portable(gather_state_dict(pipe))}
        if schedule == "1f1b":
            save_pretrained(pipe, out_dir)
    return results


def _schedules(out_dir):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, gather_state_dict, save_pretrained

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    steps = batches(GLOBAL_BATCH)
    results = {}
    for schedule, microbatches in SCHEDULE_MICROBATCHES.items():
        config = PipelineConfig(schedule=schedule, microbatches=microbatches)
        pipe = PipelinedCausalLM(tiny_model(), dims=dims, config=config)
        losses, norms = pipelined_run(pipe, steps, dp_rank=0, dp=1)
        state = portable(gather_state_dict(pipe))
        results[schedule] = {"losses": losses, "norms": norms, "state": state, "stages": pipe.stage_ids}
        if schedule == "1f1b":
            save_pretrained(pipe, os.path.join(out_dir, "full"))
            eval_batch = padded_batch(3, seed=7)  # 3 sequences: not a multiple of any micro-batch count
            results["eval"] = float(pipe.eval_step(eval_batch)[0])
    return results


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    return run_distributed(_two_ranks, 2, str(out)), out


def _lora(out_dir):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, save_pretrained

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    pipe = PipelinedCausalLM(_lora_model(), dims=dims, config=PipelineConfig(schedule="1f1b", microbatches=4))
    losses, _ = pipelined_run(pipe, batches(GLOBAL_BATCH, steps=3), dp_rank=0, dp=1)
    save_pretrained(pipe, out_dir)
    trainable = sorted(n for n, p in pipe.named_parameters() if p.requires_grad)
    return losses, trainable


def test_every_schedule_matches_one_process(two_rank_run):
    results, tmp_path = two_rank_run
    ref_losses, ref_norms, ref_state = reference_run(tiny_model(), batches(GLOBAL_BATCH))
    assert results[0]["zbv"]["stages"] == [0, 3] and results[1]["zbv"]["stages"] == [1, 2]  # V placement
    assert results[0]["interleaved_1f1b"]["stages"] == [0, 2]  # loop placement
    for schedule in SCHEDULE_MICROBATCHES:
        for rank in (0, 1):  # the last stage's loss reaches every rank
            got = results[rank][schedule]
            assert_close(got["losses"], ref_losses, atol=1e-5, rtol=0, msg=f"{schedule} loss, rank {rank}")
            assert_close(got["norms"], ref_norms, atol=1e-5, rtol=1e-5, msg=f"{schedule} grad norm, rank {rank}")
        state = results[0][schedule]["state"]
        assert results[1][schedule]["state"] is None
        assert set(state) == set(ref_state)
        for key, value in ref_state.items():
            assert_close(torch.from_numpy(state[key]), value, atol=1e-4, rtol=0, msg=f"{schedule} {key}")
    assert min(ref_norms) > 0.5  # clipping was active, so the global norm across stages mattered

    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    for key, value in saved.state_dict().items():
        assert_close(value, ref_state[key], atol=1e-4, rtol=0)
    eval_batch = padded_batch(3, seed=7)
    with torch.no_grad():
        assert_close(results[0]["eval"], float(saved(**eval_batch).loss), atol=1e-5, rtol=0)


def test_tied_embeddings_match_one_process(two_rank_run):
    from transformers import AutoModelForCausalLM

    results, tmp_path = two_rank_run
    ref_losses, ref_norms, ref_state = reference_run(tiny_model(tie_word_embeddings=True), batches(GLOBAL_BATCH))
    for schedule in TIED_SCHEDULES:
        for rank in (0, 1):
            got = results[rank]["tied"][schedule]
            assert_close(got["losses"], ref_losses, atol=1e-5, rtol=0, msg=f"tied {schedule} rank {rank}")
            assert_close(got["norms"], ref_norms, atol=1e-5, rtol=1e-5, msg=f"tied {schedule} norm")
        state = results[0]["tied"][schedule]["state"]
        for key, value in ref_state.items():
            assert_close(torch.from_numpy(state[key]), value, atol=1e-4, rtol=0, msg=f"tied {schedule} {key}")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:  # one tensor for the tied pair
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    assert saved.lm_head.weight is saved.model.embed_tokens.weight
    assert_close(saved.lm_head.weight, ref_state["lm_head.weight"], atol=1e-4, rtol=0)


def test_lora_adapter_from_stages_loads_on_a_plain_model(two_rank_run):
    from peft import PeftModel

    results, tmp_path = two_rank_run
    (losses, names0), (_, names1) = results[0]["lora"], results[1]["lora"]
    assert names0 and names1 and not set(names0) & set(names1)  # each stage holds its own adapters
    assert all("lora_" in n for n in names0 + names1)
    ref_model = _lora_model()
    ref_losses, _, _ = reference_run(ref_model, batches(GLOBAL_BATCH, steps=3))
    assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    loaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter")
    ref_lora = {k: v for k, v in ref_model.state_dict().items() if "lora_" in k}
    got_lora = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert set(got_lora) == set(ref_lora) and len(ref_lora) == 2 * 3 * LAYERS
    for key, value in ref_lora.items():
        assert_close(got_lora[key], value, atol=1e-4, rtol=0)


OPT_STEPS, OPT_LR = 3, 0.5


def _opt_model(**overrides):
    """OPT as its checkpoints are laid out -- tied embeddings, LayerNorm before each block and a final one before
    ``project_out``, biases, pad id 1 (a ``padding_idx`` in the tied embedding), positions from the mask's cumsum --
    with a projection (``word_embed_proj_dim`` 32 != hidden) and an MLP width that is not 4 x hidden. Dropout 0
    unless overridden: OPT's default is 0.1, and no layout draws one process's masks."""
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=96, num_hidden_layers=LAYERS,
                       num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=2 * SEQ,
                       **{"dropout": 0.0} | overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def _sgd_run(model, steps, step_fn):
    """``(losses, first step's gradients by HF name)`` over plain SGD steps (a tied weight under each of its names)."""
    if isinstance(model, torch.nn.Module):
        named = list(model.named_parameters(remove_duplicate=False))
    else:  # a PipelinedCausalLM: this rank's parameters (the tied copy of its stage)
        named = list(model.named_parameters())
    optimizer = torch.optim.SGD(list(model.parameters()), lr=OPT_LR)
    losses, grads = [], None
    for batch in steps:
        losses.append(float(step_fn(batch)))
        grads = grads or {n: p.grad.detach().clone().numpy() for n, p in named if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _opt_reference():
    model = _opt_model()

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    losses, grads = _sgd_run(model, batches(GLOBAL_BATCH, steps=OPT_STEPS), step)
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dropout_masks(pipe) -> tuple[list, bool]:
    """The keep-masks of every dropout this rank draws in one training step, and whether the step took exactly
    one number from the global generator (the step's seed) and left it otherwise as it was."""
    from unittest import mock

    import torch.nn.functional as F

    masks, dropout = [], F.dropout

    def recording(input, p=0.5, training=True, inplace=False):  # the same draw as F.dropout: one mask per call
        keep = dropout(torch.ones_like(input), p, training)
        if training and p > 0:
            masks.append(keep != 0)
        return input * keep

    expected = torch.Generator()
    expected.set_state(torch.get_rng_state())
    torch.randint(0, 2**62, (), generator=expected)
    with mock.patch("torch.nn.functional.dropout", recording):
        pipe.train_step(padded_batch(GLOBAL_BATCH, seed=5))
    return [m.numpy() for m in masks], bool(torch.equal(torch.get_rng_state(), expected.get_state()))


def _opt():
    """OPT (``_opt_model``) under 1F1B: SGD losses and first-step gradients; with dropout, each stage's masks; the
    train/eval mode of each stage's view of the base model after ``PipelineModel.train()`` / ``eval()``."""
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, gather_state_dict
    from hf_dist.pipeline_parallel.model import PipelineModel

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    config = PipelineConfig(schedule="1f1b", microbatches=4)
    pipe = PipelinedCausalLM(_opt_model(), dims=dims, config=config)
    losses, grads = _sgd_run(pipe, batches(GLOBAL_BATCH, steps=OPT_STEPS), pipe.train_step)
    results = {"losses": losses, "grads": grads, "state": portable(gather_state_dict(pipe))}
    loaded = _opt_model(dropout=0.1).eval()  # as from_pretrained returns it
    held = PipelineModel(PipelinedCausalLM(loaded, dims=dims, config=config))
    base_views = [m.get_submodule("model.decoder") for m in held.pipeline.modules]
    held.train()
    results["modes"] = [all(v.training for v in base_views)]
    held.eval()
    results["modes"].append(not any(v.training for v in base_views))
    held.train()
    results["masks"], results["one_draw"] = _dropout_masks(held.pipeline)
    return results


def test_opt_matches_one_process(two_rank_run):
    """OPT's checkpoint layout (tied, final norm before project_out, pad id 1, learned positions from the mask)
    under PP2: losses and first-step gradients to 1e-5, parameters after plain SGD steps to 1e-5."""
    results, _ = two_rank_run
    ref_losses, ref_grads, ref_state = _opt_reference()
    for rank in (0, 1):
        assert_close(results[rank]["opt"]["losses"], ref_losses, atol=1e-5, rtol=0, msg=f"OPT loss, rank {rank}")
    grads = {**results[0]["opt"]["grads"], **results[1]["opt"]["grads"]}  # lm_head: the last stage's tied copy
    assert set(grads) == set(ref_grads)
    for name, value in ref_grads.items():
        assert_close(torch.from_numpy(grads[name]), torch.from_numpy(value), atol=1e-5, rtol=0, msg=f"OPT grad {name}")
    state = results[0]["opt"]["state"]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        assert_close(torch.from_numpy(state[key]), value, atol=1e-5, rtol=0, msg=f"OPT SGD {key}")


def test_opt_dropout_masks_differ_between_stages(two_rank_run):
    """OPT's default dropout 0.1: every rank is seeded alike and both stages run micro-batches of one shape, so
    from the global generator the second stage's layers drew the first stage's masks, layer for layer. Each pp
    rank now has its own stream; the global generator moves by one draw per step (the step's seed)."""
    results, _ = two_rank_run
    first, second = results[0]["opt"]["masks"], results[1]["opt"]["masks"]
    assert first and second
    for i, mask in enumerate(second):
        same = [j for j, other in enumerate(first) if other.shape == mask.shape and (other == mask).all()]
        assert not same, f"the second stage's dropout mask {i} repeats the first stage's mask {same[0]}"
    keep = sum(m.sum() for m in first + second) / sum(m.size for m in first + second)
    assert abs(keep - 0.9) < 0.01  # still dropout 0.1
    assert results[0]["opt"]["one_draw"] and results[1]["opt"]["one_draw"]


def test_opt_base_model_view_follows_train_and_eval(two_rank_run):
    """A model loaded in eval mode: ``PipelineModel.train()`` must reach each stage's view of the base model
    (OPT's LayerDrop reads its ``training``), and ``eval()`` must turn it off again."""
    results, _ = two_rank_run
    assert results[0]["opt"]["modes"] == results[1]["opt"]["modes"] == [True, True]


FOUR_RANK_LAYOUTS = {  # name: (ParallelDims sizes besides pp=2, schedule, model builder)
    "fsdp": (dict(dp_shard=2), "1f1b", tiny_model),  # PP2 x FSDP2
    "ddp": (dict(dp_replicate=2, dp_shard=1), "interleaved_1f1b", tiny_model),  # PP2 x replicated DP (grad all-reduce)
    "tp": (dict(tp=2, dp_shard=1), "1f1b", tiny_model),  # PP2 x TP2 (hf_dist.tensor_parallel inside each stage)
    "phi3_tp": (dict(tp=2, dp_shard=1), "1f1b", tiny_phi3),  # PP2 x TP2, fused qkv/gate_up sharded part by part
    "tied_fsdp": (dict(dp_shard=2), "1f1b", partial(tiny_model, tie_word_embeddings=True)),  # tied copies, summed
    "zbv_fsdp": (dict(dp_shard=2), "zbv", tiny_model),  # zero bubble (split backward) x FSDP2, two stages per rank
}
FUSED_CANARY_TYPES = ("glm", "glm4", "phi3")
"""Pipeline-proven model types whose TP plan shards fused projections (``FusedColwiseParallel``)."""


def _fused_canaries(dims) -> dict[str, str | None]:
    """The layout canary on PP2 x TP2 for each fused-projection type: None when it passes, else its message."""
    from hf_dist.pipeline_parallel import PipelineConfig
    from hf_dist.pipeline_parallel.canary import check_pipeline_layout
    from pp_sweep_cases import non_default_config

    outcome = {}
    for model_type in FUSED_CANARY_TYPES:
        config = non_default_config(model_type, tie_word_embeddings=False)  # TP x PP refuses tied embeddings
        try:
            check_pipeline_layout(config, dims, PipelineConfig(schedule="1f1b", microbatches=4))
            outcome[model_type] = None
        except ValueError as error:
            outcome[model_type] = str(error)
    return outcome


def _pp_times_dp_four_ranks(rank, world_size):
    from torch.distributed.tensor import DTensor

    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, gather_state_dict

    results = {}
    for name, (sizes, schedule, build) in FOUR_RANK_LAYOUTS.items():
        dims = ParallelDims(world_size=4, pp=2, **sizes)
        dims.build_mesh("cpu")
        config = PipelineConfig(schedule=schedule, microbatches=4)
        pipe = PipelinedCausalLM(build(), dims=dims, config=config)
        losses, norms = pipelined_run(pipe, batches(GLOBAL_BATCH), dp_rank=dims.dp_rank(rank), dp=dims.dp)
        sharded = {tuple(p.device_mesh.mesh_dim_names) for p in pipe.parameters() if isinstance(p, DTensor)}
        state = portable(gather_state_dict(pipe))
        results[name] = {"losses": losses, "norms": norms, "state": state, "sharded_on": sharded}
        if name == "phi3_tp":
            results["fused_canaries"] = _fused_canaries(dims)
    return results


def test_pp_times_dp_and_tp_on_four_ranks():
    results = run_distributed(_pp_times_dp_four_ranks, 4)
    assert results[0]["fsdp"]["sharded_on"] == {("dp_shard",)}
    assert results[0]["tp"]["sharded_on"] == results[0]["phi3_tp"]["sharded_on"] == {("tp",)}
    assert results[0]["ddp"]["sharded_on"] == set()
    for rank in range(4):  # the canary used to compare fused gradients in rank-major row order and refuse
        assert results[rank]["fused_canaries"] == dict.fromkeys(FUSED_CANARY_TYPES), f"rank {rank}"
    for name, (_, _, build) in FOUR_RANK_LAYOUTS.items():
        ref_losses, ref_norms, ref_state = reference_run(build(), batches(GLOBAL_BATCH))
        for rank in range(4):
            assert_close(results[rank][name]["losses"], ref_losses, atol=1e-5, rtol=0, msg=f"{name} rank {rank}")
            assert_close(results[rank][name]["norms"], ref_norms, atol=1e-5, rtol=1e-5)
        state = results[0][name]["state"]
        for key, value in ref_state.items():
            assert_close(torch.from_numpy(state[key]), value, atol=1e-4, rtol=0, msg=f"{name} {key}")


def _pp_fsdp_tp_eight_ranks(rank, world_size):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, gather_state_dict

    dims = ParallelDims(world_size=8, pp=2, dp_shard=2, tp=2)
    dims.build_mesh("cpu")
    pipe = PipelinedCausalLM(tiny_model(), dims=dims, config=PipelineConfig(schedule="1f1b", microbatches=4))
    losses, norms = pipelined_run(pipe, batches(2 * GLOBAL_BATCH), dp_rank=dims.dp_rank(rank), dp=dims.dp)
    return losses, norms, portable(gather_state_dict(pipe))


@pytest.mark.skipif(os.environ.get("HF_DIST_SLOW") != "1", reason="8 processes: run with HF_DIST_SLOW=1 (~2 min)")
def test_pp_fsdp_tp_on_eight_ranks():
    """PP2 x FSDP2 x TP2: the whole composition. Too slow for CI on 2 cores; run by hand."""
    results = run_distributed(_pp_fsdp_tp_eight_ranks, 8, timeout_s=900)
    ref_losses, ref_norms, ref_state = reference_run(tiny_model(), batches(2 * GLOBAL_BATCH))
    for losses, norms, _ in results:
        assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        assert_close(norms, ref_norms, atol=1e-5, rtol=1e-5)
    for key, value in ref_state.items():
        assert_close(torch.from_numpy(results[0][2][key]), value, atol=1e-4, rtol=0, msg=key)

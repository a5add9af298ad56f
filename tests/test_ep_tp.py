"""EP x TP through ``DistTrainer``: 4 gloo ranks, ``tp_size=2`` x 2 data-parallel ranks, ``ep_size=2`` or 4, against
one process.

Attention (and dense MLPs: deepseek_v3's first layer and shared expert) is split by TP; each TP rank keeps its experts
whole (the TP plan's experts entry is dropped under EP) and EP splits them. transformers' dispatch slices the tokens
the TP group shares over its ranks before the exchange and gathers the outputs after it, so every token reaches its
experts once. ``ep_size=2`` puts the ep peers inside a TP group; ``ep_size=4`` spreads them over both TP groups (one
expert per rank, tokens crossing the data-parallel ranks).

Tiny qwen3_moe, mixtral, gpt_oss (router aux loss on at 0.1, non-default top-k, a sliding window of 8 tokens) and
deepseek_v3 (grouped routing, shared expert, first layer dense), loaded from disk as users load theirs, train 3 AdamW
steps with clipping active; the losses, gradient norms and every parameter (routers, experts, norms) equal a
one-process ``DistTrainer`` on the same global batch within 1e-5. Were each TP rank to send the tokens its group
shares (no slicing), the losses would still agree but the gradient norms would not: a run without the slicing checks
that the comparison sees it. One run saves at step 2 (the Trainer's default ``save_strategy``) and resumes from there
exactly. Without the aux term the routers end farther from the run's than the tolerance (qwen3_moe).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dist_utils import run_distributed
from parity import ADAM_NOISE, EP_TP_CASES, assert_parity, tiny_config
from trainer_harness import VOCAB, as_loaded, train_tiny

FSDP2 = dict(fsdp="full_shard", fsdp_config={"version": 2})
RUNS = {(name, "fsdp2", 2): FSDP2 for name in EP_TP_CASES} | {("qwen3_moe", "ddp", 2): {},
                                                              ("qwen3_moe", "fsdp2", 4): FSDP2}
"""(model type, data-parallel flavour, ep_size) -> the extra arguments; tp_size=2 everywhere."""
STEPS, MAX_NORM = 3, 0.5
BATCH = dict(max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=8, max_grad_norm=MAX_NORM)
RESUMED, SAVE_AT = ("qwen3_moe", "fsdp2", 2), 2
"""The run that also saves at step 2 and resumes from there once."""


def _model(name: str, aux: float | None = None):
    from hf_dist.models.tiny import build_tiny_model

    config = tiny_config(name, "ep_tp")
    config.vocab_size = VOCAB
    if aux is not None:
        config.router_aux_loss_coef = aux
    return as_loaded(build_tiny_model(config, seed=0))


def _norms(trainer) -> list[float]:
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


def _placements(trainer) -> dict[str, set]:
    """Per role (the experts' ``gate_up_proj``, the attention's ``q_proj``): ``{(mesh dim: placement, ..., whether
    every dimension after the first is whole on this rank)}``; a parameter that is no ``DTensor`` is ``None``."""
    from torch.distributed.tensor import DTensor

    def layout(suffix):
        return {(tuple(f"{dim}: {place}" for dim, place in zip(p.device_mesh.mesh_dim_names, p.placements)),
                 p.to_local().shape[1:] == p.shape[1:]) if isinstance(p, DTensor) else None
                for n, p in trainer.model.named_parameters() if n.endswith(suffix)}
    return {"experts": layout("experts.gate_up_proj"), "q_proj": layout("self_attn.q_proj.weight")}


@contextlib.contextmanager
def _unsliced(world: int):
    """transformers' dispatch handed a 1-rank group for the ranks that share the batch: each TP rank sends all its
    tokens, so the experts run every token once per TP rank (what the slicing prevents)."""
    import transformers.distributed.expert_parallel as ep_module
    from torch.distributed.device_mesh import init_device_mesh

    alone = init_device_mesh("cpu", (world, 1), mesh_dim_names=("all", "alone"))["alone"]
    apply = ep_module.apply_expert_parallelism
    ep_module.apply_expert_parallelism = lambda model, ep_mesh, tp_mesh, *args, **kwargs: apply(
        model, ep_mesh, alone, *args, **kwargs)
    try:
        yield
    finally:
        ep_module.apply_expert_parallelism = apply


LOADED = ("qwen3_moe", "mixtral")
"""Saved with ``save_pretrained`` (the per-expert keys of their checkpoints) and streamed by ``hf_dist.from_pretrained``
into EP x TP x FSDP2."""


def _stream(root: str, rank: int) -> dict:
    import hf_dist
    from hf_dist import DistTrainingArguments
    from hf_dist.state_dict import full_state_dict

    out = {}
    for name in LOADED:
        args = DistTrainingArguments(output_dir=f"{root}/load", fsdp2=True, tp_size=2, ep_size=2, report_to=[])
        model = hf_dist.from_pretrained(f"{root}/saved/{name}", args)
        state = full_state_dict(model)  # a collective: every rank gathers
        out[name] = (state if rank == 0 else None, _placements(SimpleNamespace(model=model)), args.layout.streaming_load)
    return out


def _four_ranks(rank, world, root):
    out = {"streamed": _stream(root, rank)}
    for (name, flavour, ep), layout in RUNS.items():
        saves = dict(save_strategy="steps", save_steps=SAVE_AT) if (name, flavour, ep) == RESUMED else {}
        losses, params, trainer = train_tiny(f"{root}/{name}_{flavour}_ep{ep}", model=_model(name), tp_size=2,
                                             ep_size=ep, **BATCH, **layout, **saves)
        dims = (trainer.dims.dp, trainer.dims.tp, trainer.dims.ep)
        out[(name, flavour, ep)] = (losses, _norms(trainer), params if rank == 0 else None, _placements(trainer), dims)
    with _unsliced(world):
        losses, _, trainer = train_tiny(f"{root}/unsliced", model=_model("qwen3_moe"), tp_size=2, ep_size=2, **BATCH,
                                        **FSDP2)
    out["unsliced"] = (losses, _norms(trainer))
    name, flavour, ep = RESUMED
    losses, params, _ = train_tiny(f"{root}/resumed", model=_model(name), tp_size=2, ep_size=ep, **BATCH,
                                   **RUNS[RESUMED], resume=f"{root}/{name}_{flavour}_ep{ep}/checkpoint-{SAVE_AT}")
    out["resumed"] = (losses, params if rank == 0 else None)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from hf_dist.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("ep_tp")
    for name in LOADED:
        build_tiny_model(tiny_config(name, "ep_tp"), seed=1).save_pretrained(root / "saved" / name)
    return root


@pytest.fixture(scope="module")
def runs(root):
    return run_distributed(_four_ranks, 4, str(root), timeout_s=1500)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_tp_one")
    out = {}
    for name in EP_TP_CASES:
        losses, params, trainer = train_tiny(str(root / name), model=_model(name), **BATCH)
        out[name] = {"losses": losses, "norms": _norms(trainer), "state": params}
    return out


@pytest.mark.parametrize("run", sorted(RUNS), ids=lambda run: "-".join(map(str, run)))
def test_ep_tp_equals_one_process(runs, references, run):
    from torch.distributed.tensor import Shard

    name, _, ep = run
    config = tiny_config(name, "ep_tp")
    for rank, result in enumerate(runs):
        losses, norms, _, placements, dims = result[run]
        assert dims == (2, 2, ep), rank
        # the experts split over ep by whole experts (every feature of each), not over tp; q_proj split over tp
        (experts,) = placements["experts"]
        assert f"ep: {Shard(0)}" in experts[0] and not any("tp" in p for p in experts[0]) and experts[1], experts
        if name != "deepseek_v3":  # its latent attention stays whole (no q_proj)
            (q_proj,) = placements["q_proj"]
            assert f"tp: {Shard(0)}" in q_proj[0], q_proj
        assert min(norms) > MAX_NORM, rank  # clipping active on every step
        torch.testing.assert_close(losses, references[name]["losses"], atol=1e-5, rtol=0)
    losses, norms, params, *_ = runs[0][run]
    # one weight element of a barely trained row: parity.ADAM_NOISE (measured 1.7e-5, gpt_oss embedding row 136)
    assert_parity({"losses": losses, "norms": norms, "state": params}, references[name], config=config,
                  state_atol=ADAM_NOISE, what=f"{name} {run}")


def test_the_streaming_load_fills_each_ranks_slices(runs, root):
    """``hf_dist.from_pretrained`` under EP x TP x FSDP2 streams each rank's attention and expert slices (experts from
    the per-expert keys on disk, assembled by transformers' converter): the gathered model is the one-process load."""
    from transformers import AutoModelForCausalLM

    for name in LOADED:
        expected = AutoModelForCausalLM.from_pretrained(str(root / "saved" / name), dtype=torch.float32).state_dict()
        state, placements, streamed = runs[0]["streamed"][name]
        assert streamed and all(result["streamed"][name][1] == placements for result in runs)
        (experts,) = placements["experts"]
        (q_proj,) = placements["q_proj"]
        assert any(p.startswith("ep:") for p in experts[0]) and any(p.startswith("tp:") for p in q_proj[0])
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, atol=0, rtol=0, msg=lambda m: f"{name} {key}: {m}")


def test_a_checkpoint_resumes_exactly(runs):
    """Saved at step 2 (attention shards over tp, expert shards over ep, optimizer states), resumed: step 3 equals the
    run without a cut."""
    for result in runs:
        losses, _, params, *_ = result[RESUMED]
        resumed_losses, resumed_params = result["resumed"]
        assert len(resumed_losses) == STEPS  # the first two from the checkpoint's log history
        torch.testing.assert_close(resumed_losses[-1], losses[-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(runs[0]["resumed"][1], runs[0][RESUMED][2], atol=1e-6, rtol=0)


def test_without_the_token_slicing_the_norms_tell(runs, references):
    """Were the TP ranks to send the tokens they share each (no slicing before the exchange), every expert output is
    still right, so the losses agree within the tolerance; the experts' gradients count each token once per TP rank,
    and the gradient norms are off by far more than the 1e-5 the comparison allows."""
    losses, norms = runs[0]["unsliced"]
    torch.testing.assert_close(losses, references["qwen3_moe"]["losses"], atol=1e-5, rtol=0)
    assert abs(norms[0] / references["qwen3_moe"]["norms"][0] - 1) > 1e-4


def test_dropping_the_aux_loss_fails_the_comparison(runs, tmp_path):
    """The aux term (coefficient 0.1) moves the routers by far more than the parity tolerance."""
    _, no_aux, _ = train_tiny(str(tmp_path / "no_aux"), model=_model("qwen3_moe", aux=0.0), **BATCH)
    params = runs[0][RESUMED][2]
    routers = [k for k in params if k.endswith("mlp.gate.weight")]
    assert routers and max(float((params[k] - no_aux[k]).abs().max()) for k in routers) > 1e-4


# -- pure: the rules, before any process group ------------------------------------------------------------------------
def test_layout_runs_ep_x_tp_only_as_proven():
    from hf_dist.strategy import Layout

    for strategy in ("fsdp_full_shard", "ddp"):
        for ep in (2, 4):
            layout = Layout(strategy=strategy, num_gpus=4, tp=2, ep=ep)
            assert (layout.dp, layout.efsdp) == (2, 4 // ep)
    refused = {"strategy='fsdp_shard_grad_op'": dict(strategy="fsdp_shard_grad_op"),
               "tp_sequence_parallel=True": dict(sequence_parallel=True),
               "tp_vocab_parallel=True": dict(vocab_parallel=True), "lora_rank=8": dict(lora_rank=8)}
    for message, change in refused.items():
        with pytest.raises(ValueError, match=f"ep_size=2 with tp_size=2 and {message}"):
            Layout(**(dict(strategy="fsdp_full_shard", num_gpus=4, tp=2, ep=2) | change))
    with pytest.raises(ValueError, match="ep_size=2 with tp_size=2 and pp_size=2"):
        Layout(strategy="fsdp_full_shard", num_gpus=8, tp=2, ep=2, pp=2)
    with pytest.raises(ValueError, match="ep_size=2 with tp_size=2 and cp_size=2"):
        Layout(strategy="ddp", num_gpus=8, tp=2, ep=2, cp=2)
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide the 4 ranks \(dp 2 x tp_size 2"):
        Layout(strategy="ddp", num_gpus=4, tp=2, ep=3)


def test_the_trl_trainers_refuse_ep_x_tp():
    from types import SimpleNamespace

    from hf_dist.strategy import Layout
    from hf_dist.trl_support import dpo_layout_refusal, grpo_layout_refusal

    layout = Layout(strategy="ddp", num_gpus=4, tp=2, ep=2)
    assert "ep_size=2 with tp_size=2 in DistGRPOConfig" in grpo_layout_refusal(layout, SimpleNamespace())
    assert dpo_layout_refusal(layout).startswith("ep_size=2 in DistDPOConfig")  # DPO refuses EP of any kind


def test_a_type_without_its_ep_tp_case_is_refused_by_name():
    """olmoe runs EP (and, being unproven for TP, is refused there too); EP x TP is refused by its own record."""
    from ep_cases import moe_config

    from hf_dist.strategy import Layout
    from hf_dist.support import model_refusals

    layout = Layout(strategy="fsdp_full_shard", num_gpus=4, tp=2, ep=2)
    assert model_refusals(tiny_config("qwen3_moe", "ep_tp"), layout) == []
    reasons = model_refusals(moe_config("olmoe"), layout)
    assert any("ep_size=2 with tp_size=2 is refused: model_type='olmoe' has no EP x TP parity case" in r
               for r in reasons), reasons

"""EP x PP through ``DistTrainer``: 4 gloo ranks, ``pp_size=2`` x 2 data-parallel ranks per stage, ``ep_size=2`` (each
stage's experts split over its own 2 data-parallel ranks, the rest FSDP2 FULL_SHARD or DDP), against one process.

Tiny qwen3_moe, mixtral and gpt_oss (4 experts, router aux loss on at 0.1; gpt_oss with attention sinks and a sliding
window of 8 on its first layer) and deepseek_v3 (MLA, grouped routing with a score-correction bias, a shared expert; no
aux loss in its code; its first layer dense, so the first stage holds no experts), loaded from disk as users load
theirs, train 3 AdamW steps with clipping active; the losses and every parameter (routers, experts, norms) equal a one-process
``DistTrainer`` on the same global batch (accumulation 4 of the same 2-row micro-batches: the aux loss is the model's
own per micro-batch, ``hf_dist.models.reference``) within 1e-5. The router statistics travel with the hidden states
between stages (``pipeline_parallel.stage_module``); without the aux term the first stage's routers move differently
by far more than the tolerance (checked once, on qwen3_moe), so a stage whose aux gradient were lost fails here. The
layout canary runs at launch on every run (``layout_canary`` on by default) and must agree. With activation
checkpointing too (it crashed: the router statistics were computed inside the checkpointed layers). One run saves at
step 2 (the Trainer's default ``save_strategy``) and resumes from there exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dist_utils import run_distributed
from ep_cases import moe_config
from parity import EP_PP_CASES, assert_parity
from trainer_harness import VOCAB, as_loaded, train_tiny

CASES = EP_PP_CASES
FLAVOURS = {"fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}), "ddp": {},
            # the stages' router hooks keep the logits and sum them after the stage: recomputation replays exactly
            "fsdp2_recompute": dict(fsdp="full_shard", fsdp_config={"version": 2}, gradient_checkpointing=True)}
STEPS, AUX, MAX_NORM = 3, 0.1, 0.5
BATCH = dict(max_steps=STEPS, per_device_train_batch_size=2, global_batch_size=8, max_grad_norm=MAX_NORM)
CASE_FLAVOURS = {name: tuple(FLAVOURS) for name in ("qwen3_moe", "mixtral")} | {
    name: ("fsdp2", "ddp") for name in ("gpt_oss", "deepseek_v3")}
"""The layouts per model type: activation checkpointing (model-independent stage code) on the first two only."""
DENSE_FIRST_STAGE = {"deepseek_v3"}
"""Types whose first stage holds only dense layers (``first_k_dense_replace=1`` of 2 layers): no experts there."""
RESUMED, SAVE_AT = ("qwen3_moe", "fsdp2"), 2
"""The run that also saves at step 2 (the Trainer's default ``save_strategy``), and resumes from there once."""


def _model(name: str, aux: float = AUX):
    from hf_dist.models.tiny import build_tiny_model

    config = moe_config(name, aux=aux)
    config.vocab_size = VOCAB
    return as_loaded(build_tiny_model(config, seed=0))


def _norms(trainer) -> list[float]:
    return [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]


class _CanaryLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def _four_ranks(rank, world, root):
    from torch.distributed.tensor import DTensor

    canary = _CanaryLog()
    logger = logging.getLogger("hf_dist.pipeline_parallel.canary")
    logger.addHandler(canary)
    logger.setLevel(logging.INFO)
    out = {}
    for name in CASES:
        for flavour in CASE_FLAVOURS[name]:
            layout = FLAVOURS[flavour]
            saves = dict(save_strategy="steps", save_steps=SAVE_AT) if (name, flavour) == RESUMED else {}
            losses, params, trainer = train_tiny(f"{root}/{name}_{flavour}", model=_model(name), pp_size=2, ep_size=2,
                                                 **BATCH, **layout, **saves)
            experts = [p for n, p in trainer.model.named_parameters() if n.endswith("experts.gate_up_proj")]
            held = [p.to_local().shape[0] if isinstance(p, DTensor) else None for p in experts]  # experts per layer
            out[(name, flavour)] = (losses, _norms(trainer), params if rank == 0 else None, held,
                                    trainer.dims.ep, trainer.dims.pp)
    name, flavour = RESUMED
    checkpoint = f"{root}/{name}_{flavour}/checkpoint-{SAVE_AT}"
    losses, params, _ = train_tiny(f"{root}/resumed", model=_model(name), pp_size=2, ep_size=2, resume=checkpoint,
                                   **BATCH, **FLAVOURS[flavour])
    out["resumed"] = (losses, params if rank == 0 else None)
    return out, canary.messages


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_pp")
    return root, run_distributed(_four_ranks, 4, str(root), timeout_s=1500)


@pytest.fixture(scope="module")
def references(runs):
    root, _ = runs
    return {name: train_tiny(str(root / f"one_{name}"), model=_model(name), **BATCH)[:2] for name in CASES}


@pytest.mark.parametrize(("name", "flavour"), [(n, f) for n in CASES for f in CASE_FLAVOURS[n]])
def test_ep_pp_equals_one_process(runs, references, name, flavour):
    _, results = runs
    ref_losses, ref_params = references[name]
    holding = 0
    for rank, (result, _) in enumerate(results):
        losses, norms, params, held, ep, pp = result[(name, flavour)]
        assert (ep, pp) == (2, 2) and set(held) <= {2}, rank  # 2 of the 4 experts of each of its stage's layers
        holding += bool(held)
        assert len(losses) == STEPS and min(norms) > MAX_NORM  # clipping active on every step
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    assert holding == (2 if name in DENSE_FIRST_STAGE else 4)  # a dense stage's 2 ranks hold no experts
    losses, _, params, *_ = results[0][0][(name, flavour)]
    assert_parity({"losses": losses, "state": params}, {"losses": ref_losses, "state": ref_params},
                  config=moe_config(name), what=f"{name} {flavour}")


def test_the_layout_canary_agreed_on_every_run(runs):
    _, results = runs
    messages = results[0][1]  # rank 0 logs the verdict
    agreed = [m for m in messages if m.startswith("layout canary:") and "ep=2" in m and "reproduces" in m]
    assert len(agreed) == sum(map(len, CASE_FLAVOURS.values())) + 1, messages  # and the resumed run


def test_a_checkpoint_resumes_exactly(runs):
    """Saved at step 2 (expert shards and optimizer states of every stage), resumed: step 3 as the run without a cut."""
    _, results = runs
    for result, _ in results:
        losses, _, params, *_ = result[RESUMED]
        resumed_losses, resumed_params = result["resumed"]
        assert len(resumed_losses) == STEPS  # the first two from the checkpoint's log history
        torch.testing.assert_close(resumed_losses[-1], losses[-1], atol=1e-6, rtol=0)
    torch.testing.assert_close(results[0][0]["resumed"][1], results[0][0][RESUMED][2], atol=1e-6, rtol=0)


def test_dropping_the_aux_loss_fails_the_comparison(runs, references, tmp_path):
    """The aux term moves the first stage's routers by far more than the parity tolerance (once, on qwen3_moe)."""
    _, results = runs
    _, no_aux = train_tiny(str(tmp_path / "no_aux"), model=_model("qwen3_moe", aux=0.0), **BATCH)[:2]
    params = results[0][0][("qwen3_moe", "fsdp2")][2]
    routers = [k for k in params if k.startswith("model.layers.0.") and k.endswith("mlp.gate.weight")]
    assert routers and max(float((params[k] - no_aux[k]).abs().max()) for k in routers) > 1e-4

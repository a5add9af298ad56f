"""The parity harness itself (``tests/parity.py``): its reference is the model's own loss, its comparison fails on a
router, norm or expert weight alone, and its batches are fresh every step. One process, a few seconds."""

from __future__ import annotations

import pytest
import torch

from ep_cases import moe_config, token_batches
from parity import MOE_ADAMW, Recipe, assert_parity, masked_batches, reference_run, split_rows, tiny_model


@pytest.fixture(scope="module")
def qwen3_moe():
    """Two runs of the reference on one tiny MoE (aux loss on), and the model's own per-micro-batch losses."""
    batches = token_batches(2, 4)
    steps = [split_rows(batch, 2) for batch in batches]
    first = reference_run(tiny_model(moe_config("qwen3_moe")), steps, MOE_ADAMW, grads=True)
    second = reference_run(tiny_model(moe_config("qwen3_moe")), steps, MOE_ADAMW, grads=True)
    model = tiny_model(moe_config("qwen3_moe"))
    with torch.no_grad():  # equal token counts per micro-batch: the mean of their means
        own = sum(float(model(**micro).loss) / len(steps[0]) for micro in steps[0])
    return first, second, own


def test_the_reference_is_the_models_own_loss_per_micro_batch(qwen3_moe):
    first, _, own = qwen3_moe
    assert abs(first["losses"][0] - own) < 1e-6


def test_equal_runs_pass_and_every_role_is_compared(qwen3_moe):
    first, second, _ = qwen3_moe
    assert_parity(second, first, config=moe_config("qwen3_moe"))


@pytest.mark.parametrize("part", ["mlp.gate.weight", "input_layernorm.weight", "mlp.experts.down_proj"])
def test_one_router_norm_or_expert_weight_off_by_2e_5_fails(qwen3_moe, part):
    first, second, _ = qwen3_moe
    for key in ("grads", "state"):
        changed = {**second, key: dict(second[key])}
        name = next(n for n in changed[key] if part in n)
        changed[key][name] = changed[key][name] + 2e-5
        with pytest.raises(AssertionError, match=name.replace(".", r"\.")):
            assert_parity(changed, first, config=moe_config("qwen3_moe"))


def test_a_comparison_without_router_weights_fails(qwen3_moe):
    first, second, _ = qwen3_moe

    def drop(run):
        return {**run, "grads": {}, "state": {k: v for k, v in run["state"].items() if ".gate." not in k}}

    with pytest.raises(AssertionError, match="no router weight compared"):
        assert_parity(drop(second), drop(first), config=moe_config("qwen3_moe"))


def test_dropping_the_aux_loss_changes_the_router_gradient():
    steps = [split_rows(token_batches(1, 4)[0], 2)]
    with_aux = reference_run(tiny_model(moe_config("qwen3_moe")), steps, Recipe(lr=0.1, optimizer="sgd"), grads=True)
    without = reference_run(tiny_model(moe_config("qwen3_moe")), steps, Recipe(lr=0.1, optimizer="sgd"), grads=True,
                            aux=False)
    router = [n for n in with_aux["grads"] if n.endswith("mlp.gate.weight")]
    assert router and max(float((with_aux["grads"][n] - without["grads"][n]).abs().max()) for n in router) > 1e-4


def test_rows_are_fresh_every_step_and_padding_is_unlabelled():
    steps = masked_batches(64, 16, 3)
    assert not torch.equal(steps[0]["input_ids"], steps[1]["input_ids"])
    for step in steps:
        assert ((step["labels"] == -100) == (step["attention_mask"] == 0)).all()


def test_a_model_loaded_from_disk_gives_the_same_reference(qwen3_moe):
    """``tiny_model(loaded=True)`` (saved and read back with ``from_pretrained``, eval mode, as users load it):
    the same weights, and the same reference run (aux loss included) as the model built from its config."""
    first, _, _ = qwen3_moe
    steps = [split_rows(batch, 2) for batch in token_batches(2, 4)]
    loaded = tiny_model(moe_config("qwen3_moe"), loaded=True)
    assert not loaded.training
    assert_parity(reference_run(loaded, steps, MOE_ADAMW, grads=True), first, config=moe_config("qwen3_moe"))


def test_the_trainer_harness_one_process_is_the_reference(tmp_path):
    """``trainer_harness.trainer_run`` in one process (the Trainer-level reference) equals ``reference_run`` over the
    micro-batches the Trainer ran: its first step's loss, gradient norm and gradients (2 micro-batches; both
    recorded before clipping, which is active) and the parameters after its clipped AdamW step (the Trainer's: no
    weight decay)."""
    from trainer_harness import VOCAB, RecordingCollator, trainer_run

    from hf_dist.models import build_tiny_model

    collator, max_norm = RecordingCollator(), 0.05
    run, trainer = trainer_run(str(tmp_path), max_steps=1, global_batch_size=4, max_grad_norm=max_norm,
                               trainer_kwargs={"data_collator": collator})
    assert trainer.args.gradient_accumulation_steps == 2 and len(collator.batches) >= 2
    assert run["norms"][0] > max_norm  # clipping changed the step: the gradients were recorded before it
    model = tiny_model(build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2).config, loaded=True)
    ref = reference_run(model, [collator.batches[:2]], Recipe(lr=1e-3, weight_decay=0.0, max_norm=max_norm),
                        grads=True)
    assert_parity(run, ref, what="one-process Trainer vs reference_run")


def test_a_trl_run_is_compared_through_assert_parity(qwen3_moe):
    """``assert_trl_parity`` (the TRL trainers' tests): losses, the evaluation loss, grad norms, every weight with the
    router and experts required, and the other logged figures; each of these off, or missing on one side, fails."""
    from trl_parity import assert_trl_parity

    first, second, _ = qwen3_moe
    config = moe_config("qwen3_moe")
    logs = {"loss": first["losses"], "grad_norm": [1.0, 0.5], "rewards/margins": [0.0, 0.25], "eval_loss": 2.0}
    assert_trl_parity(logs, second["state"], logs, first["state"], config=config)
    router = next(n for n in first["state"] if ".mlp.gate." in n)
    no_router = {k: v for k, v in second["state"].items() if k != router}
    off = [({**logs, "eval_loss": 2.0 + 2e-5}, second["state"], "losses"),
           ({**logs, "grad_norm": [1.0, 0.5 + 2e-5]}, second["state"], "grad norms"),
           ({**logs, "rewards/margins": [0.0, 0.25 + 2e-5]}, second["state"], "rewards/margins"),
           ({k: v for k, v in logs.items() if k != "rewards/margins"}, second["state"], "logged figures differ"),
           (logs, no_router, "state keys differ")]
    for metrics, state, message in off:
        with pytest.raises(AssertionError, match=message):
            assert_trl_parity(metrics, state, logs, first["state"], config=config)
    routers = {n for n in first["state"] if ".mlp.gate." in n}  # every layer's: a comparison that skipped them
    with pytest.raises(AssertionError, match="no router weight compared"):
        assert_trl_parity(logs, {k: v for k, v in second["state"].items() if k not in routers}, logs,
                          {k: v for k, v in first["state"].items() if k not in routers}, config=config)


def test_a_failed_spawn_is_raised_again_not_rerun(monkeypatch):
    import dist_utils

    calls = []

    def failing(fn, world_size, *args, timeout_s):
        calls.append(world_size)
        raise RuntimeError("rank 1 failed")

    monkeypatch.setattr(dist_utils, "run_distributed", failing)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="rank 1 failed"):
            dist_utils.spawn_once("harness_check_failing", None, 2)
    assert calls == [2]
    monkeypatch.setattr(dist_utils, "run_distributed", lambda fn, world_size, *args, timeout_s: ["ok"] * world_size)
    assert dist_utils.spawn_once("harness_check_ok", None, 2) == dist_utils.spawn_once("harness_check_ok", None, 3)

"""The MoE router aux loss weighs ``router_aux_loss_coef`` whatever the split of the global batch.

Tiny qwen3_moe (``parity.tiny_config``: 4 experts, top-3, aux coefficient 0.5 so a wrong weight moves the loss by
~1; loaded from disk as a user's), global batch 8, every comparison through ``parity.assert_parity`` (losses, the first
optimizer step's gradients, every parameter, router and experts included):
- one process, micro 2 x accumulation 4: the first step equals ``parity.reference_run``'s AdamW step on the same 4
  micro-batches with loss ``token-mean LM + coef x mean(aux)`` (the old weight was coef x sum);
- micro-batch scope: 2 gloo ranks (DDP and FSDP2) at micro 2 x accumulation 2 equal one process at micro 2 x 4
  (``trainer_harness.trainer_run``);
- global-batch scope: 2 ranks at micro 4 equal one process computing the aux on all 8 sequences (micro 8);
- ``--dist_logging`` logs the expert load per layer.
"""

import tempfile

import pytest
import torch

from dist_utils import run_distributed
from parity import Recipe, assert_parity, reference_run, tiny_config, tiny_model
from trainer_harness import VOCAB, train_tiny, trainer_run

COEF = 0.5
STEPS = 3


def _config():
    config = tiny_config("qwen3_moe", "ep")
    config.vocab_size = VOCAB
    assert config.router_aux_loss_coef == COEF and config.output_router_logits
    return config


def moe_model():
    return tiny_model(_config(), loaded=True)


def _train(micro: int, steps: int = STEPS, **overrides):
    with tempfile.TemporaryDirectory() as out:
        return trainer_run(out, max_steps=steps, model=moe_model(), global_batch_size=8,
                           per_device_train_batch_size=micro, **overrides)


def test_aux_weight_is_coef_times_the_mean_over_accumulation_steps():
    """The Trainer's first step (AdamW, its default weight decay 0, clipping at 1.0) against ``reference_run`` on the
    4 micro-batches it ran (the aux weighted coef x mean over micro-batches: ``hf_dist.models.reference``, the
    layout canary's reference too)."""
    run, trainer = _train(micro=2, steps=1)
    assert trainer.args.gradient_accumulation_steps == 4
    batches = [b for _, b in zip(range(4), trainer.get_train_dataloader())]
    ref = reference_run(moe_model(), [[{k: v for k, v in b.items() if k != "attention_mask"} for b in batches]],
                        Recipe(lr=1e-3, weight_decay=0.0, max_norm=1.0), grads=True)
    assert ref["norms"][0] < 1.0  # no clipping: the gradients reference_run records are those the optimizer reads
    assert_parity(run, ref, config=_config(), what="DistTrainer vs reference_run")


@pytest.fixture(scope="module")
def single():
    return {micro: _train(micro, dist_logging=True)[0] for micro in (2, 8)}


def _ranks(rank, world_size):
    results = {}
    for name, micro, extra in (
        ("ddp_micro", 2, {}),
        ("fsdp2_micro", 2, {"fsdp": "full_shard", "fsdp_config": {"version": 2}}),
        ("ddp_global", 4, {"router_aux_loss_scope": "global_batch"}),
        ("fsdp2_global", 4, {"router_aux_loss_scope": "global_batch", "fsdp": "full_shard",
                             "fsdp_config": {"version": 2}}),
    ):
        run, trainer = _train(micro, **extra)
        results[name] = (run, trainer.accelerator.num_processes)
    return results


def test_splits_over_ranks_equal_one_process(single):
    results = run_distributed(_ranks, 2)[0]
    for name, (run, processes) in results.items():
        assert processes == 2
        reference = single[2] if name.endswith("micro") else single[8]
        assert_parity(run, reference, config=_config(), what=f"{name} vs one process")
    # the flag changes the result: the global scope at micro 4 is not the per-micro-batch aux of micro 4
    per_micro = _train(4)[0]["losses"]
    assert max(abs(a - b) for a, b in zip(per_micro, single[8]["losses"])) > 1e-4


def test_dist_logging_reports_expert_load_per_layer():
    with tempfile.TemporaryDirectory() as out:
        _, _, trainer = train_tiny(out, max_steps=1, model=moe_model(), global_batch_size=8,
                                   per_device_train_batch_size=4, dist_logging=True)
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    loads = {k: v for k, v in log.items() if k.startswith("expert_load_max_over_mean/")}
    assert sorted(loads) == ["expert_load_max_over_mean/layer0", "expert_load_max_over_mean/layer1"]
    config = _config()  # 4 experts, top-3: at most 4/3 of the mean
    assert all(1.0 <= v <= config.num_experts / config.num_experts_per_tok for v in loads.values())


def test_unknown_scope_is_refused():
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="router_aux_loss_scope='tokens' is not a scope"):
        DistTrainingArguments(output_dir="unused", router_aux_loss_scope="tokens", use_cpu=True)


def test_global_scope_with_pipeline_is_refused():
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="router_aux_loss_scope='global_batch' with pp_size=2"):
        DistTrainingArguments(output_dir="unused", router_aux_loss_scope="global_batch", pp_size=2, use_cpu=True)

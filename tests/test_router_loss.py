"""The MoE router aux loss weighs ``router_aux_loss_coef`` whatever the split of the global batch.

Tiny qwen3_moe (4 experts, top-2, aux coefficient 0.5 so a wrong weight moves the loss by ~1), global batch 8:
- one process, micro 2 x accumulation 4: the first step's loss and weights equal a hand-written AdamW step on
  the same 4 micro-batches with loss ``token-mean LM + coef x mean(aux)`` (the old weight was coef x sum);
- micro-batch scope: 2 gloo ranks (DDP and FSDP2) at micro 2 x accumulation 2 equal one process at micro 2 x 4;
- global-batch scope: 2 ranks at micro 4 equal one process computing the aux on all 8 sequences (micro 8);
- ``--dist_logging`` logs the expert load per layer.
"""

import tempfile

import pytest
import torch

from dist_utils import run_distributed
from hf_dist.models.reference import reference_step
from trainer_harness import VOCAB, train_tiny

COEF = 0.5
STEPS = 3


def moe_model():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=COEF,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _train(micro: int, steps: int = STEPS, **overrides):
    with tempfile.TemporaryDirectory() as out:
        return train_tiny(out, max_steps=steps, model=moe_model(), global_batch_size=8,
                          per_device_train_batch_size=micro, **overrides)


def _hand_step(micro_batches):
    """One AdamW step as the Trainer's arguments define it, with the aux weighted coef x mean over micro-batches
    (``hf_dist.models.reference``, the layout canary's reference too)."""
    model = moe_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    total = reference_step(model, micro_batches)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return total, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_aux_weight_is_coef_times_the_mean_over_accumulation_steps():
    losses, params, trainer = _train(micro=2, steps=1)
    assert trainer.args.gradient_accumulation_steps == 4
    batches = [b for _, b in zip(range(4), trainer.get_train_dataloader())]
    expected_loss, expected = _hand_step([{k: v for k, v in b.items() if k != "attention_mask"} for b in batches])
    torch.testing.assert_close(losses[0], expected_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(params, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def single():
    return {micro: _train(micro, dist_logging=True)[:2] for micro in (2, 8)}


def _ranks(rank, world_size):
    results = {}
    for name, micro, extra in (
        ("ddp_micro", 2, {}),
        ("fsdp2_micro", 2, {"fsdp": "full_shard", "fsdp_config": {"version": 2}}),
        ("ddp_global", 4, {"router_aux_loss_scope": "global_batch"}),
        ("fsdp2_global", 4, {"router_aux_loss_scope": "global_batch", "fsdp": "full_shard",
                             "fsdp_config": {"version": 2}}),
    ):
        losses, params, trainer = _train(micro, **extra)
        results[name] = (losses, params, trainer.accelerator.num_processes)
    return results


def test_splits_over_ranks_equal_one_process(single):
    results = run_distributed(_ranks, 2)[0]
    for name, (losses, params, processes) in results.items():
        assert processes == 2
        reference = single[2] if name.endswith("micro") else single[8]
        torch.testing.assert_close(losses, reference[0], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(params, reference[1], atol=1e-5, rtol=0, msg=name)
    # the flag changes the result: the global scope at micro 4 is not the per-micro-batch aux of micro 4
    per_micro = _train(4)[0]
    assert max(abs(a - b) for a, b in zip(per_micro, single[8][0])) > 1e-4


def test_dist_logging_reports_expert_load_per_layer():
    with tempfile.TemporaryDirectory() as out:
        _, _, trainer = train_tiny(out, max_steps=1, model=moe_model(), global_batch_size=8,
                                   per_device_train_batch_size=4, dist_logging=True)
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    loads = {k: v for k, v in log.items() if k.startswith("expert_load_max_over_mean/")}
    assert sorted(loads) == ["expert_load_max_over_mean/layer0", "expert_load_max_over_mean/layer1"]
    assert all(1.0 <= v <= 4.0 / 2 for v in loads.values())  # 4 experts, top-2: at most twice the mean


def test_unknown_scope_is_refused():
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="router_aux_loss_scope='tokens' is not a scope"):
        DistTrainingArguments(output_dir="unused", router_aux_loss_scope="tokens", use_cpu=True)


def test_global_scope_with_pipeline_is_refused():
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="router_aux_loss_scope='global_batch' with pp_size=2"):
        DistTrainingArguments(output_dir="unused", router_aux_loss_scope="global_batch", pp_size=2, use_cpu=True)

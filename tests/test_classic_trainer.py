"""DistTrainer with tp_size=2 and with pp_size=2 on classic model types (hf_dist's own plans: GPT-2's Conv1D
layers and fused ``c_attn``, BLOOM's per-head ALiBi) on 2 gloo ranks against the single-process HF Trainer:
losses, grad norms (clipping active), eval loss and the saved model. One spawned group runs every case."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from pp_harness import LR, PaddedDataset, VOCAB

STEPS, GLOBAL_BATCH, MICRO, MAX_NORM = 3, 8, 4, 0.5
CASES = ("gpt2", "bloom")
LAYOUTS = ({"tp_size": 2}, {"pp_size": 2, "pp_schedule": "1f1b"})


def _config(model_type: str):
    """Tiny configs with non-default values: untied head, scaled/upcast attention (GPT-2), 6 heads (BLOOM's
    ALiBi slopes for a head count that is not a power of two), residual after the norm."""
    from transformers import AutoConfig

    if model_type == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=64, n_layer=4, n_head=4, n_inner=96, vocab_size=VOCAB,
                                    tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True,
                                    reorder_and_upcast_attn=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    bos_token_id=0, eos_token_id=0)
    return AutoConfig.for_model("bloom", hidden_size=96, n_layer=4, n_head=6, vocab_size=VOCAB,
                                tie_word_embeddings=False, apply_residual_connection_post_layernorm=True,
                                hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                                pad_token_id=0)


def _model(model_type: str):
    from hf_dist.models.tiny import build_tiny_model

    model = build_tiny_model(_config(model_type), seed=0)
    # GPT2LMHeadModel has loss_type None, so the HF Trainer counts num_items_in_batch over the unshifted labels
    # (one token per row too many) and scales its loss by that count; the pipeline computes the true token mean.
    # Naming the loss makes the Trainer count shifted labels: every run below then trains the true mean.
    model.loss_type = "ForCausalLM"
    return model


def _common_args(output_dir: str) -> dict:
    return dict(
        output_dir=output_dir, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no", eval_strategy="no",
        per_device_eval_batch_size=4, report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )


def _run(trainer, output_dir: str) -> dict:
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(f"{output_dir}/final")
    history = [log for log in trainer.state.log_history if "loss" in log and "train_runtime" not in log]
    return {"losses": [log["loss"] for log in history], "norms": [log["grad_norm"] for log in history],
            "eval_loss": eval_loss}


def _dist(rank, world_size, output_dir):
    from hf_dist import DistTrainer, DistTrainingArguments

    results = {}
    for model_type in CASES:
        for layout in LAYOUTS:
            name = f"{model_type}-{next(iter(layout))}"
            args = DistTrainingArguments(
                **_common_args(f"{output_dir}/{name}"), per_device_train_batch_size=MICRO,
                global_batch_size=GLOBAL_BATCH, **layout,
            )
            trainer = DistTrainer(model=_model(model_type), args=args, train_dataset=PaddedDataset(32, seed=1),
                                  eval_dataset=PaddedDataset(8, seed=2))
            results[name] = _run(trainer, f"{output_dir}/{name}")
    return results


def _reference(model_type: str, output_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**_common_args(output_dir), per_device_train_batch_size=GLOBAL_BATCH, use_cpu=True)
    trainer = Trainer(model=_model(model_type), args=args, train_dataset=PaddedDataset(32, seed=1),
                      eval_dataset=PaddedDataset(8, seed=2))
    return _run(trainer, output_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("classic_trainer")
    per_rank = run_distributed(_dist, 2, str(root / "dist"), timeout_s=900)
    return root, per_rank, {t: _reference(t, str(root / "ref" / t)) for t in CASES}


@pytest.mark.parametrize("model_type", CASES)
@pytest.mark.parametrize("layout", [next(iter(layout)) for layout in LAYOUTS])
def test_dist_trainer_matches_single_process_trainer(runs, model_type, layout):
    from transformers import AutoModelForCausalLM

    root, per_rank, refs = runs
    ref, name = refs[model_type], f"{model_type}-{layout}"
    assert len(ref["losses"]) == STEPS and min(ref["norms"]) > MAX_NORM  # clipping active: the global norm matters
    for by_name in per_rank:
        result = by_name[name]
        assert_close(result["losses"], ref["losses"], atol=1e-4, rtol=0)  # the Trainer logs 4 significant digits
        assert_close(result["norms"], ref["norms"], atol=1e-5, rtol=1e-5)
        assert_close(result["eval_loss"], ref["eval_loss"], atol=1e-5, rtol=0)
    saved = AutoModelForCausalLM.from_pretrained(root / "dist" / name / "final").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(root / "ref" / model_type / "final").state_dict()
    assert saved.keys() == reference.keys()
    for key, value in saved.items():
        assert_close(value, reference[key], atol=1e-4, rtol=0, msg=key)  # AdamW: float noise of ~0 grads, as in test_tp_trainer

"""DistTrainer with tp_size=2 (plain, and with sequence + vocab parallelism) on 2 gloo ranks against the
single-process HF Trainer: losses, grad norms (clipping active), eval loss, predictions (one copy per example,
not one per TP rank) and the saved model."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from pp_harness import LR, PaddedDataset, tiny_model

STEPS, GLOBAL_BATCH, MICRO, MAX_NORM = 4, 8, 4, 0.5
EVAL_BATCH = 3
VARIANTS = (("tp", False, False), ("tp_sp_vp", True, True))
"""(name, tp_sequence_parallel, tp_vocab_parallel)"""


def _common_args(output_dir: str) -> dict:
    return dict(
        output_dir=output_dir, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no", eval_strategy="no",
        per_device_eval_batch_size=EVAL_BATCH, report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )


def _history(trainer, key: str) -> list[float]:
    return [log[key] for log in trainer.state.log_history if key in log and "train_runtime" not in log]


def _run(trainer, output_dir: str) -> dict:
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    predictions = trainer.predict(PaddedDataset(7, seed=2)).predictions
    trainer.save_model(f"{output_dir}/final")
    return {
        "losses": _history(trainer, "loss"), "norms": _history(trainer, "grad_norm"),
        "eval_loss": eval_loss, "predictions": predictions,
    }


def _tp_trainer(rank, world_size, output_dir):
    from hf_dist import DistTrainer, DistTrainingArguments

    results = {}
    for name, sequence_parallel, vocab_parallel in VARIANTS:
        out = f"{output_dir}/{name}"
        args = DistTrainingArguments(
            **_common_args(out), per_device_train_batch_size=MICRO, global_batch_size=GLOBAL_BATCH, tp_size=2,
            tp_sequence_parallel=sequence_parallel, tp_vocab_parallel=vocab_parallel,
        )
        assert args.gradient_accumulation_steps == 2  # 8 = dp 1 x micro 4 x accumulation 2: TP ranks are not dp
        trainer = DistTrainer(
            model=tiny_model(), args=args, train_dataset=PaddedDataset(32, seed=1),
            eval_dataset=PaddedDataset(8, seed=2),
        )
        from torch.distributed.tensor import DTensor

        norm = trainer.model.model.layers[0].input_layernorm.weight
        assert isinstance(norm, DTensor) == sequence_parallel  # the norms run on sequence shards only with SP
        # the head is column-split in every variant (its own plan: logits gathered; vocab-parallel: kept sharded)
        assert isinstance(trainer.model.lm_head.weight, DTensor)
        assert trainer.model._hf_dist_tp.vocab_parallel == vocab_parallel
        results[name] = _run(trainer, out)
    return results


def _reference(output_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**_common_args(output_dir), per_device_train_batch_size=GLOBAL_BATCH, use_cpu=True)
    trainer = Trainer(
        model=tiny_model(), args=args, train_dataset=PaddedDataset(32, seed=1), eval_dataset=PaddedDataset(8, seed=2)
    )
    return _run(trainer, output_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_trainer")
    return root, run_distributed(_tp_trainer, 2, str(root / "tp")), _reference(str(root / "ref"))


@pytest.mark.parametrize("variant", [name for name, _, _ in VARIANTS])
def test_dist_trainer_tp2_matches_single_process_trainer(runs, variant):
    _, per_rank, ref = runs
    assert len(ref["losses"]) == STEPS and min(ref["norms"]) > MAX_NORM  # clipping active: the global norm matters
    for result in (by_variant[variant] for by_variant in per_rank):
        assert_close(result["losses"], ref["losses"], atol=1e-4, rtol=0)  # the Trainer logs 4 significant digits
        assert_close(result["norms"], ref["norms"], atol=1e-5, rtol=1e-5)
        assert_close(result["eval_loss"], ref["eval_loss"], atol=1e-5, rtol=0)
        assert result["predictions"].shape == ref["predictions"].shape  # 7 examples, not 7 x tp
        assert_close(torch.as_tensor(result["predictions"]), torch.as_tensor(ref["predictions"]), atol=1e-4, rtol=0)


def test_sequence_parallel_needs_tp(tmp_path):
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="tp_sequence_parallel=True needs tp_size > 1"):
        DistTrainingArguments(output_dir=str(tmp_path), tp_sequence_parallel=True)


@pytest.mark.parametrize("variant", [name for name, _, _ in VARIANTS])
def test_dist_trainer_tp2_saves_a_normal_hf_directory(runs, variant):
    from transformers import AutoModelForCausalLM

    root, _, _ = runs
    saved = AutoModelForCausalLM.from_pretrained(root / "tp" / variant / "final").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(root / "ref" / "final").state_dict()
    assert saved.keys() == reference.keys()
    for key, value in saved.items():
        assert_close(value, reference[key], atol=1e-4, rtol=0, msg=key)

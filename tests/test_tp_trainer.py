"""DistTrainer with tp_size=2 (plain, with sequence + vocab parallelism, and with sequence parallelism on a tied head)
on 2 gloo ranks against one process: losses, grad norms (clipping active) and every parameter against the parity
harness's one process (``reference_run``, through ``assert_parity``); eval loss and predictions (one copy per example,
not one per TP rank) against the HF Trainer evaluating that one-process model; the saved model.

The model is the parity harness's TP case (``parity.tiny_config``: ``tp_sweep_cases``' non-default values; its
untied variant, whose head TP splits, and the tied type), loaded from disk as users load theirs; 4 plain SGD steps on
padded rows of different lengths, global batch 8 = micro 4 x accumulation 2 (TP ranks are not data-parallel).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from parity import Recipe, assert_parity, reference_run, split_rows, tiny_config, tiny_model
from pp_harness import PaddedDataset
from trainer_harness import train_tiny

STEPS, GLOBAL_BATCH, MICRO, MAX_NORM, LR = 4, 8, 4, 0.5, 0.1
EVAL_BATCH = 3
SGD = Recipe(lr=LR, optimizer="sgd", max_norm=MAX_NORM)
VARIANTS = {"tp": ("llama:untied", False, False), "tp_sp_vp": ("llama:untied", True, True),
            "tp_sp_tied": ("llama", True, False)}
"""name -> (config case, tp_sequence_parallel, tp_vocab_parallel)"""


def _train_data() -> PaddedDataset:
    return PaddedDataset(4 * GLOBAL_BATCH, seed=1)


def _eval_data() -> tuple[PaddedDataset, PaddedDataset]:
    return PaddedDataset(8, seed=2), PaddedDataset(7, seed=2)


def _evaluate(trainer) -> dict:
    evaluation, prediction = _eval_data()
    return {"eval_loss": trainer.evaluate(evaluation)["eval_loss"],
            "predictions": trainer.predict(prediction).predictions}


def _tp_trainer(rank, world_size, output_dir):
    from torch.distributed.tensor import DTensor

    results = {}
    for name, (case, sequence_parallel, vocab_parallel) in VARIANTS.items():
        out = f"{output_dir}/{name}"
        losses, params, trainer = train_tiny(
            out, model=tiny_model(tiny_config(case, "tp"), loaded=True), dataset=_train_data(), max_steps=STEPS,
            per_device_train_batch_size=MICRO, global_batch_size=GLOBAL_BATCH, tp_size=2,
            tp_sequence_parallel=sequence_parallel, tp_vocab_parallel=vocab_parallel, learning_rate=LR, optim="sgd",
            max_grad_norm=MAX_NORM, train_sampling_strategy="sequential", per_device_eval_batch_size=EVAL_BATCH,
        )
        assert trainer.args.gradient_accumulation_steps == 2  # 8 = dp 1 x micro 4 x accumulation 2
        norm = trainer.model.model.layers[0].input_layernorm.weight
        assert isinstance(norm, DTensor) == sequence_parallel  # the norms run on sequence shards only with SP
        # the untied head is column-split (its own plan: logits gathered; vocab-parallel: kept sharded); tied, whole
        assert isinstance(trainer.model.lm_head.weight, DTensor) == (case == "llama:untied")
        assert trainer.model._hf_dist_tp.vocab_parallel == vocab_parallel
        norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
        trainer.save_model(f"{out}/final")
        results[name] = {"run": {"losses": losses, "norms": norms, "state": params}, **_evaluate(trainer)}
    return results


def _reference(case: str, output_dir: str) -> dict:
    """The harness's one process on the Trainer's steps (sequential rows, micro-batches of ``MICRO``), then the HF
    Trainer's own evaluation and prediction of the trained model."""
    from transformers import Trainer, TrainingArguments

    model = tiny_model(tiny_config(case, "tp"), loaded=True)
    rows = _train_data().rows
    steps = [split_rows({k: v[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH] for k, v in rows.items()},
                        GLOBAL_BATCH // MICRO) for s in range(STEPS)]
    run = reference_run(model, steps, SGD)
    args = TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=EVAL_BATCH, use_cpu=True, report_to=[],
                             disable_tqdm=True, dataloader_num_workers=0)
    return {"run": run, **_evaluate(Trainer(model=model, args=args))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_trainer")
    references = {case: _reference(case, str(root / "ref")) for case in {case for case, _, _ in VARIANTS.values()}}
    return root, run_distributed(_tp_trainer, 2, str(root / "tp")), references


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dist_trainer_tp2_matches_single_process(runs, variant):
    _, per_rank, references = runs
    ref = references[VARIANTS[variant][0]]
    assert len(ref["run"]["losses"]) == STEPS and min(ref["run"]["norms"]) > MAX_NORM  # clipping active
    for rank, result in enumerate(by_variant[variant] for by_variant in per_rank):
        # the Trainer logs losses to 4 decimals
        assert_parity(result["run"], ref["run"], atol=1e-4, state_atol=1e-5, what=f"rank {rank} {variant}")
        assert_close(result["eval_loss"], ref["eval_loss"], atol=1e-5, rtol=0)
        assert result["predictions"].shape == ref["predictions"].shape  # 7 examples, not 7 x tp
        assert_close(torch.as_tensor(result["predictions"]), torch.as_tensor(ref["predictions"]), atol=1e-5, rtol=0)


def test_sequence_parallel_needs_tp(tmp_path):
    from hf_dist import DistTrainingArguments

    with pytest.raises(ValueError, match="tp_sequence_parallel=True needs tp_size > 1"):
        DistTrainingArguments(output_dir=str(tmp_path), tp_sequence_parallel=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dist_trainer_tp2_saves_a_normal_hf_directory(runs, variant):
    from transformers import AutoModelForCausalLM

    root, _, references = runs
    saved = AutoModelForCausalLM.from_pretrained(root / "tp" / variant / "final").state_dict()
    reference = references[VARIANTS[variant][0]]["run"]["state"]
    assert saved.keys() == reference.keys()
    for key, value in saved.items():
        assert_close(value, reference[key], atol=1e-5, rtol=0, msg=key)

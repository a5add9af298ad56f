"""DistTrainer with pp_size=2 on 2 gloo ranks against a single-process HF Trainer: losses, grad norms, eval, save.

The model is the harness's case (``parity.tiny_config("llama:gqa", "pp")``, loaded from disk as users load theirs),
the rows padded to different lengths (``parity.masked_batches``); both Trainers run plain SGD with clipping active,
so the saved parameters compare the gradients (``parity.assert_parity``: 1e-5; logged losses to 1e-4, as the
Trainer rounds them).
"""

from __future__ import annotations

import pytest
from torch.testing import assert_close

from dist_utils import run_distributed
from parity import PP_SGD, assert_parity, masked_batches, tiny_config, tiny_model
from pp_sweep_cases import SEQ

CASE = "llama:gqa"
STEPS, GLOBAL_BATCH, MICRO = 4, 8, 2
TRAIN_ROWS = 28  # the 4th step's batch is short (4 rows): the pipeline runs 2 micro-batches instead of 4


def _rows(n: int, seed: int) -> list[dict]:
    """``n`` right-padded rows (``masked_batches``), the same on every rank: token counts differ per micro-batch."""
    batch = masked_batches(tiny_config(CASE, "pp").vocab_size, SEQ, seed + 1, rows=n)[seed]
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def _model():
    return tiny_model(tiny_config(CASE, "pp"), loaded=True)


def _metrics() -> dict:
    from hf_dist.data import compute_metrics, preprocess_logits_for_metrics

    return dict(compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)


def _common_args(output_dir: str) -> dict:
    return dict(
        output_dir=output_dir,
        max_steps=STEPS,
        learning_rate=PP_SGD.lr,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=PP_SGD.max_norm,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        per_device_eval_batch_size=4,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )


def _history(trainer, key: str) -> list[float]:
    return [log[key] for log in trainer.state.log_history if key in log and "train_runtime" not in log]


def _pp_trainer(rank, world_size, output_dir, schedule):
    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(
        **_common_args(output_dir),
        per_device_train_batch_size=MICRO,
        global_batch_size=GLOBAL_BATCH,
        pp_size=2,
        pp_schedule=schedule,
        gradient_checkpointing=True,  # recomputation inside stages changes nothing numerically
    )
    assert (args.gradient_accumulation_steps, args.pp_microbatches, args.per_device_train_batch_size) == (1, 4, MICRO)
    trainer = DistTrainer(
        model=_model(),
        args=args,
        train_dataset=_rows(TRAIN_ROWS, seed=1),
        eval_dataset=_rows(8, seed=2),
        **_metrics(),
    )
    assert trainer._train_batch_size == GLOBAL_BATCH  # one data-loader batch = all micro-batches of a step
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(f"{output_dir}/final")
    return _history(trainer, "loss"), _history(trainer, "grad_norm"), metrics


def _reference(output_dir: str):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**_common_args(output_dir), per_device_train_batch_size=GLOBAL_BATCH, use_cpu=True)
    trainer = Trainer(
        model=_model(),
        args=args,
        train_dataset=_rows(TRAIN_ROWS, seed=1),
        eval_dataset=_rows(8, seed=2),
        **_metrics(),
    )
    trainer.train()
    return _history(trainer, "loss"), _history(trainer, "grad_norm"), trainer.evaluate(), trainer.model


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_dist_trainer_pp2_matches_single_process_trainer(tmp_path, schedule):
    results = run_distributed(_pp_trainer, 2, str(tmp_path / "pp"), schedule)
    ref_losses, ref_norms, ref_eval, ref_model = _reference(str(tmp_path / "ref"))
    assert len(ref_losses) == STEPS and min(ref_norms) > PP_SGD.max_norm  # clipping active: the global norm matters
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "final").state_dict()
    ref = {"losses": ref_losses, "norms": ref_norms, "state": ref_model.state_dict()}
    for rank, (losses, norms, metrics) in enumerate(results):  # every rank logs the last stage's loss
        # the Trainer rounds logged losses to 4 significant digits; the saved parameters to 1e-5
        assert_parity({"losses": losses, "norms": norms, "state": saved}, ref, atol=1e-4, state_atol=1e-5,
                      what=f"rank {rank}")
        assert_close(metrics["eval_loss"], ref_eval["eval_loss"], atol=1e-5, rtol=0)
        # perplexity from logits (compute_metrics): the logits reach every rank
        assert_close(metrics["eval_perplexity"], ref_eval["eval_perplexity"], atol=1e-4, rtol=1e-6)


def _fake_args(**values):
    """The fields ``fold_accumulation_into_pipeline`` reads (TrainingArguments would start a process group)."""
    from types import SimpleNamespace

    from hf_dist.trainer.args import resolve_contract

    args = SimpleNamespace(layout=SimpleNamespace(pp=2), pp_schedule="1f1b", pp_microbatches=None,
                           global_batch_size=None, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    vars(args).update(values)

    def resolve():
        return resolve_contract(world_size=2, micro_batch_size=args.per_device_train_batch_size,
                                global_batch_size=args.global_batch_size,
                                gradient_accumulation_steps=args.gradient_accumulation_steps, pp_size=2)

    args._resolve_contract = resolve
    args.batch_contract = resolve()
    args.gradient_accumulation_steps = args.batch_contract.gradient_accumulation_steps
    return args


def test_accumulation_becomes_pipeline_microbatches():
    from hf_dist.pipeline_parallel.microbatches import fold_accumulation_into_pipeline

    args = _fake_args(global_batch_size=8)
    fold_accumulation_into_pipeline(args)
    assert (args.pp_microbatches, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2, 1)
    again = _fake_args(global_batch_size=8, pp_microbatches=4)  # re-created from the folded values: same contract
    fold_accumulation_into_pipeline(again)
    assert (again.pp_microbatches, again.gradient_accumulation_steps) == (4, 1)
    args = _fake_args(pp_microbatches=4)  # no global batch: pp_microbatches defines it
    fold_accumulation_into_pipeline(args)
    assert args.batch_contract.global_batch_size == 8
    assert (args.pp_microbatches, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2, 1)
    again = _fake_args(pp_microbatches=4)
    fold_accumulation_into_pipeline(again)
    assert again.batch_contract.global_batch_size == 8
    with pytest.raises(ValueError, match="pp_microbatches=3 contradicts the batch contract.*global_batch_size=6"):
        fold_accumulation_into_pipeline(_fake_args(global_batch_size=8, pp_microbatches=3))
    with pytest.raises(ValueError, match="pp_schedule='nope' is not known"):
        fold_accumulation_into_pipeline(_fake_args(global_batch_size=8, pp_schedule="nope"))


def test_too_few_microbatches_split_the_micro_batch_or_stop_with_the_smallest_valid_values():
    from hf_dist.pipeline_parallel.microbatches import fold_accumulation_into_pipeline

    args = _fake_args(per_device_train_batch_size=8)  # bare pp_size=2: the Trainer's default micro batch, 1 step
    fold_accumulation_into_pipeline(args)  # 8 rows per rank run as 2 micro-batches of 4: the global batch kept
    assert (args.pp_microbatches, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4, 1)
    assert args.batch_contract.global_batch_size == 8
    message = (r"pp_schedule='1f1b' needs at least pp_size=2 micro-batches.*gives 1 .*Set pp_microbatches=2 \(or "
               r"gradient_accumulation_steps=2, or global_batch_size=2\)")
    with pytest.raises(ValueError, match=message):  # one row per rank cannot split
        fold_accumulation_into_pipeline(_fake_args(per_device_train_batch_size=1))
    with pytest.raises(ValueError, match="needs at least pp_size=2"):  # stated explicitly: never changed behind it
        fold_accumulation_into_pipeline(_fake_args(per_device_train_batch_size=8, pp_microbatches=1))
    args = _fake_args(per_device_train_batch_size=1, pp_schedule="gpipe")  # GPipe runs one micro-batch
    fold_accumulation_into_pipeline(args)
    assert args.pp_microbatches == 1
    with pytest.raises(ValueError, match="interleaved_1f1b.*3 does not split into 2 equal rounds|5 does not split"):
        fold_accumulation_into_pipeline(_fake_args(per_device_train_batch_size=1, gradient_accumulation_steps=5,
                                                   pp_schedule="interleaved_1f1b"))


def test_microbatch_rule_matches_torch_schedules():
    from hf_dist.pipeline_parallel.schedules import microbatch_problem, smallest_valid_microbatches

    assert microbatch_problem("1f1b", 1, 2) and microbatch_problem("1f1b", 2, 2) is None
    assert microbatch_problem("interleaved_zb", 5, 2) and microbatch_problem("interleaved_zb", 6, 2) is None
    assert smallest_valid_microbatches("1f1b", 4) == 4 and smallest_valid_microbatches("gpipe", 4) == 1
    assert smallest_valid_microbatches("interleaved_1f1b", 2, at_least=5) == 6


def _bare_pp_rank(rank, world_size, model_dir, output_dir):
    """``--pp_size 2`` and nothing else about the pipeline, through hf_dist.from_pretrained and the Trainer."""
    import hf_dist
    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(output_dir=output_dir, pp_size=2, max_steps=1, report_to=[], save_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0, layout_canary=False)
    model = hf_dist.from_pretrained(model_dir, args)
    trainer = DistTrainer(model=model, args=args, train_dataset=_rows(16, seed=1))
    result = trainer.train()
    return (args.per_device_train_batch_size, args.pp_microbatches, args.batch_contract.global_batch_size,
            result.training_loss)


def test_bare_pp_size_2_runs_through_from_pretrained_and_the_trainer(tmp_path):
    model_dir = tmp_path / "model"
    _model().save_pretrained(model_dir)
    results = run_distributed(_bare_pp_rank, 2, str(model_dir), str(tmp_path / "out"))
    assert [r[:3] for r in results] == [(4, 2, 8)] * 2  # the default micro batch 8 split in 2: global batch 8
    assert results[0][3] == results[1][3] and results[0][3] > 0

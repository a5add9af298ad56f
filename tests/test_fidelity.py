"""Drop-in fidelity: the same script run with ``Trainer`` and with ``DistTrainer`` is observed the same way.

Written from the Trainer's documented behaviour: its default callbacks, what ``save_strategy``/``save_steps`` write
into ``output_dir`` and each checkpoint, ``state.log_history`` (also after ``resume_from_checkpoint``), best-model
tracking with ``load_best_model_at_end``, ``model_init`` (a fresh model per ``train()``), and ``evaluate``/``predict``
outputs. The Trainer's own timing keys (``*_runtime``, ``*_per_second``) differ between any two runs and are left
out, as the Trainer's tests do. One process on CPU (fp32) and DDP on 2 gloo ranks, where both train the same
numbers; then 2 gloo ranks check that ``model_init``'s every model gets hf_dist's layout (FSDP2, TP), as
``hyperparameter_search`` needs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from trainer_harness import token_dataset

TIMING_SUFFIXES = ("_runtime", "_per_second")


def _model_init(calls: list | None = None):
    from hf_dist.models import build_tiny_model

    def init():
        if calls is not None:
            calls.append(1)
        return build_tiny_model(vocab_size=256, hidden_size=32, num_hidden_layers=2, seed=0)

    return init


def _token_accuracy(prediction) -> dict[str, float]:
    predicted = np.argmax(prediction.predictions[:, :-1], axis=-1)
    return {"token_accuracy": float((predicted == prediction.label_ids[:, 1:]).mean())}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in log.items() if not k.endswith(TIMING_SUFFIXES)} for log in trainer.state.log_history]


def _script(trainer_cls, args_cls, root: Path) -> dict:
    """A Trainer user's script: model_init, eval + save every 2 steps, best model by a non-default rule, resume."""
    settings = dict(
        max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=8, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=1, logging_steps=2, eval_strategy="steps", eval_steps=2,
        save_strategy="steps", save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
        greater_is_better=True,  # the worst loss counts as best: checkpoint-2 is loaded at the end, not the last
        report_to=[], seed=3, disable_tqdm=True, dataloader_num_workers=0, use_cpu=True,
    )
    train, evaluation = token_dataset(48, seed=1), token_dataset(16, seed=2)
    first = trainer_cls(args=args_cls(output_dir=str(root / "run"), **settings), model_init=_model_init(),
                        train_dataset=train, eval_dataset=evaluation, compute_metrics=_token_accuracy)
    callbacks = [type(cb).__name__ for cb in first.callback_handler.callbacks]
    first.train()
    prediction = first.predict(evaluation)
    evaluated = first.evaluate()
    resumed = trainer_cls(args=args_cls(output_dir=str(root / "resumed"), **settings), model_init=_model_init(),
                          train_dataset=train, eval_dataset=evaluation, compute_metrics=_token_accuracy)
    resumed.train(resume_from_checkpoint=str(root / "run" / "checkpoint-4"))
    return {
        "callbacks": callbacks,
        "files": _files(root / "run"),
        "resumed_files": _files(root / "resumed"),
        "log_history": _logs(first),
        "resumed_log_history": _logs(resumed),
        "best": (first.state.best_metric, Path(first.state.best_model_checkpoint).name, first.state.best_global_step),
        "params": {k: v.detach().clone() for k, v in first.model.state_dict().items()},
        "predictions": prediction.predictions,
        "label_ids": prediction.label_ids,
        "predict_metrics": {k: v for k, v in prediction.metrics.items() if not k.endswith(TIMING_SUFFIXES)},
        "evaluate": {k: v for k, v in evaluated.items() if not k.endswith(TIMING_SUFFIXES)},
    }


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    from transformers import Trainer, TrainingArguments

    from hf_dist import DistTrainer, DistTrainingArguments

    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))] + ["WORLD_SIZE"]:
        os.environ.pop(key, None)
    return (_script(Trainer, TrainingArguments, tmp_path_factory.mktemp("trainer")),
            _script(DistTrainer, DistTrainingArguments, tmp_path_factory.mktemp("dist")))


def test_default_callbacks_are_the_trainers(observed):
    plain, dist = observed
    assert dist["callbacks"] == plain["callbacks"]


def test_output_dir_and_checkpoint_files_are_the_trainers(observed):
    plain, dist = observed
    assert "checkpoint-2/trainer_state.json" in plain["files"]  # the script really checkpointed
    assert dist["files"] == plain["files"]
    assert dist["resumed_files"] == plain["resumed_files"]


def test_log_history_matches_also_after_resume(observed):
    plain, dist = observed
    kept = [log for log in plain["resumed_log_history"] if log["step"] <= 4]
    assert kept == [log for log in plain["log_history"] if log["step"] <= 4]  # the resume kept the history
    for key in ("log_history", "resumed_log_history"):
        assert [sorted(log) for log in dist[key]] == [sorted(log) for log in plain[key]]  # no extra keys
        torch.testing.assert_close(dist[key], plain[key], rtol=1e-5, atol=1e-6)


def test_best_model_tracking_matches(observed):
    plain, dist = observed
    assert plain["best"][1] == "checkpoint-2"  # greater_is_better=True on the loss: the first, worst one
    assert dist["best"][1:] == plain["best"][1:]
    torch.testing.assert_close(dist["best"][0], plain["best"][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(dist["params"], plain["params"], rtol=1e-5, atol=1e-6)  # the best one was loaded


def test_predict_and_evaluate_outputs_match(observed):
    plain, dist = observed
    np.testing.assert_allclose(dist["predictions"], plain["predictions"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dist["label_ids"], plain["label_ids"])
    assert "test_token_accuracy" in plain["predict_metrics"]
    for key in ("predict_metrics", "evaluate"):
        assert sorted(dist[key]) == sorted(plain[key])
        torch.testing.assert_close(dist[key], plain[key], rtol=1e-5, atol=1e-6)


def _ddp_rank(rank, world_size, root):
    from transformers import Trainer, TrainingArguments

    from hf_dist import DistTrainer, DistTrainingArguments

    return (_script(Trainer, TrainingArguments, Path(root) / "trainer"),
            _script(DistTrainer, DistTrainingArguments, Path(root) / "dist"))


def test_same_observations_under_ddp_on_two_ranks(tmp_path):
    """The same script on 2 gloo ranks (the plain Trainer with use_cpu=True, which it needs on CPU)."""
    for plain, dist in run_distributed(_ddp_rank, 2, str(tmp_path)):
        assert dist["callbacks"] == plain["callbacks"]
        assert dist["files"] == plain["files"] and dist["resumed_files"] == plain["resumed_files"]
        for key in ("log_history", "resumed_log_history"):
            assert [sorted(log) for log in dist[key]] == [sorted(log) for log in plain[key]]
            torch.testing.assert_close(dist[key], plain[key], rtol=1e-5, atol=1e-6)
        assert dist["best"][1:] == plain["best"][1:]
        torch.testing.assert_close(dist["params"], plain["params"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dist["predictions"], plain["predictions"], rtol=1e-5, atol=1e-5)


def test_dist_logging_adds_the_jsonl_and_throughput_keys(tmp_path):
    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.report import LOG_FILE, read_log_history

    args = DistTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 disable_tqdm=True, use_cpu=True, dist_logging=True)
    trainer = DistTrainer(model_init=_model_init(), args=args, train_dataset=token_dataset(16))
    trainer.train()
    assert "LogHistoryCallback" in [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    records = read_log_history(tmp_path)
    assert (tmp_path / LOG_FILE).is_file() and [r["step"] for r in records if "loss" in r] == [1, 2]
    assert all("tokens_per_second" in r and "peak_memory_gb/rank0" in r for r in records if "loss" in r)


def _model_init_rank(rank, world_size):
    """model_init under FSDP2 and under TP: the model of every call (init, each train()) is laid out."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from hf_dist import DistTrainer, DistTrainingArguments

    observed = {}
    for layout, extra in (("fsdp2", {"fsdp2": True}), ("tp", {"tp_size": 2})):
        calls: list = []
        laid_out = []

        class Recording(DistTrainer):
            def call_model_init(self, trial=None):
                model = super().call_model_init(trial)
                params = list(model.parameters())
                local = [p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params]
                laid_out.append({
                    "dtensors": sum(isinstance(p, DTensor) for p in params),
                    "fsdp": any(isinstance(m, FSDPModule) for m in model.modules()),
                    "local_fraction": sum(local) / sum(p.numel() for p in params),
                })
                return model

        with tempfile.TemporaryDirectory() as out:
            args = DistTrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2,
                                         learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                         disable_tqdm=True, seed=0, **extra)
            trainer = Recording(model_init=_model_init(calls), args=args, train_dataset=token_dataset(16))
            runs = []
            for _ in range(2):  # hyperparameter_search calls train() once per trial
                trainer.train()
                runs.append([log["loss"] for log in trainer.state.log_history if "loss" in log])
        observed[layout] = {"calls": len(calls), "laid_out": laid_out, "runs": runs}
    return observed


def test_model_init_gets_the_layout_on_every_call():
    for rank_result in run_distributed(_model_init_rank, 2):
        for layout, seen in rank_result.items():
            assert seen["calls"] == 3  # __init__, then a fresh model for each train()
            assert len(seen["laid_out"]) == 3
            for model in seen["laid_out"]:
                assert model["dtensors"] >= 14 and model["local_fraction"] < 0.8, (layout, model)  # really sharded
                assert model["fsdp"] == (layout == "fsdp2")
            assert seen["runs"][0] == seen["runs"][1]  # each trial starts from a fresh, identically laid-out model

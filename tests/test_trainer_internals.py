"""Guarded internals: every private Trainer method DistTrainer overrides is listed in ``hf_dist.trainer.internals``,
still exists with the same parameters, is still called by the Trainer method the list names, and is called in a
real run (FSDP2 owned by hf_dist on one gloo rank: accumulation, clipping, eval, best model, save, resume)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from transformers import Trainer

from dist_utils import run_distributed
from hf_dist.trainer import internals
from hf_dist.trainer.trainer import DistTrainer

OVERRIDES = {m.name: m for m in internals.overrides()}


def test_every_private_override_is_listed():
    overridden = {
        name for name, value in vars(DistTrainer).items()
        if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(Trainer, name)
    }
    assert overridden == set(OVERRIDES)


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_override_matches_the_trainer_signature(name):
    ours = list(inspect.signature(getattr(DistTrainer, name)).parameters)
    theirs = list(inspect.signature(getattr(Trainer, name)).parameters)
    assert ours == theirs, f"Trainer.{name}{theirs} vs DistTrainer.{name}{ours}"


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_override_is_called_where_listed(name):
    caller = getattr(Trainer, OVERRIDES[name].called_by)
    tree = ast.parse(textwrap.dedent(inspect.getsource(caller)))
    calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"}
    assert name in calls, f"Trainer.{OVERRIDES[name].called_by} no longer uses self.{name}"


def test_a_missing_member_stops_with_the_versions(monkeypatch):
    internals.check_internals()
    monkeypatch.delattr(Trainer, "_clip_grad_norm")
    with pytest.raises(RuntimeError, match=r"transformers.Trainer._clip_grad_norm.*transformers>=5.23,<5.24"):
        internals.check_internals()


def _recording_trainer(calls: list[str]):
    def wrap(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return getattr(DistTrainer, name)(self, *args, **kwargs)
        return method

    return type("RecordingTrainer", (DistTrainer,), {name: wrap(name) for name in OVERRIDES})


def _one_rank_run(rank, world_size, output_dir):
    from hf_dist import DistTrainingArguments
    from pp_harness import PaddedDataset, tiny_model

    calls: list[str] = []
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        max_grad_norm=0.5, learning_rate=1e-3, save_strategy="steps", save_steps=2, eval_strategy="steps",
        eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss", report_to=[],
        disable_tqdm=True, fsdp="full_shard", fsdp_config={"version": 2},
    )
    data = dict(train_dataset=PaddedDataset(32, seed=1), eval_dataset=PaddedDataset(4, seed=2))
    trainer = _recording_trainer(calls)(model=tiny_model(), args=DistTrainingArguments(**common), **data)
    trainer.train()
    trainer.save_model(f"{output_dir}/final")
    resumed = _recording_trainer(calls)(model=tiny_model(), args=DistTrainingArguments(**common), **data)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-2")
    return sorted(set(calls))


def test_every_override_is_called_in_a_real_run(tmp_path):
    (called,) = run_distributed(_one_rank_run, 1, str(tmp_path))
    assert called == sorted(OVERRIDES)

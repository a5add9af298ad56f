"""Behaviour transformers' own Trainer tests (tests/trainer) observe, checked on ``DistTrainer`` in one process.

Each test is one found by running the Trainer's suite with ``Trainer`` swapped for ``DistTrainer``: it passed with
the Trainer and failed with ``DistTrainer``.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_dist import DistTrainer, DistTrainingArguments


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None):
        y = input_x * self.a
        return (torch.nn.functional.mse_loss(y, labels), y)


class _Data:
    def __init__(self, n):
        self.x = np.random.default_rng(0).normal(size=n).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.x[i]}


def test_train_dataloader_total_batch_size_and_length_are_the_trainers(tmp_path):
    # upstream test_trainer_data.py::test_train_and_eval_dataloaders reads accelerate's total_batch_size
    args = DistTrainingArguments(str(tmp_path), per_device_train_batch_size=16, report_to=[])
    trainer = DistTrainer(_Regression(), args, train_dataset=_Data(66))
    loader = trainer.get_train_dataloader()
    assert loader.total_batch_size == 16
    assert len(loader) == 66 // 16 + 1

    args = DistTrainingArguments(str(tmp_path), per_device_train_batch_size=16, dataloader_drop_last=True,
                                 report_to=[])
    loader = DistTrainer(_Regression(), args, train_dataset=_Data(66)).get_train_dataloader()
    assert loader.total_batch_size == 16
    assert len(loader) == 66 // 16


class _Classifier(torch.nn.Module):
    """A model with no ``config`` and no output head (upstream test_trainer_resume.py's ``DummyModel`` kind)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, input_ids, labels=None):
        logits = self.linear(input_ids)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _Rows:
    def __init__(self, n):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 8, generator=gen)
        self.y = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def _train_and_resume(trainer_cls, args_cls, out):
    """Two steps saving every step, then a fresh trainer resuming from checkpoint-1 to step 3: its log and weights."""
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="steps", save_steps=1,
                  logging_steps=1, learning_rate=0.1, report_to=[], seed=0)
    trainer_cls(_Classifier(), args_cls(str(out), max_steps=2, **common), train_dataset=_Rows(13)).train()
    resumed = trainer_cls(_Classifier(), args_cls(str(out), max_steps=3, **common), train_dataset=_Rows(13))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    losses = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry]
    return losses, {k: v.detach().clone() for k, v in resumed.model.state_dict().items()}


def test_resume_a_model_without_config_as_the_trainer(tmp_path):
    # upstream test_trainer_resume.py::test_resume_with_original_trainer and test_trainer_checkpointing.py's
    # TrainerInterruptedTrainingTest: the default chunked loss read ``model.config`` of a model that has none
    from transformers import Trainer, TrainingArguments

    losses, weights = _train_and_resume(DistTrainer, DistTrainingArguments, tmp_path / "dist")
    ref_losses, ref_weights = _train_and_resume(Trainer, TrainingArguments, tmp_path / "trainer")
    assert len(losses) == 3  # step 1 from the checkpoint's state, steps 2 and 3 trained after the resume
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)

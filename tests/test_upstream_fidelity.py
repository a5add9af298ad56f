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

"""Trainer glue: ``DistTrainer`` and ``DistTrainingArguments``, drop-in for the HF classes."""

from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.trainer import DistTrainer

__all__ = ["DistTrainer", "DistTrainingArguments"]

"""hf_dist: take Hugging Face causal LMs from one GPU to many.

Public API: ``ParallelDims`` (the layout), ``BatchContract`` (global batch and LR scaling),
``DistTrainer`` / ``DistTrainingArguments`` (drop-in replacements for the HF Trainer classes).
"""

from hf_dist.batch import BatchContract, scale_learning_rate
from hf_dist.parallel_dims import ParallelDims

__version__ = "0.1.0"

__all__ = ["BatchContract", "ParallelDims", "scale_learning_rate", "__version__"]

"""hf_dist: take Hugging Face causal LMs from one GPU to many.

Public API: ``ParallelDims`` (the layout), ``BatchContract`` (global batch and LR scaling),
``DistTrainer`` / ``DistTrainingArguments`` (drop-in replacements for the HF Trainer classes),
``from_pretrained`` (a model loaded straight into the layout of its arguments, each rank reading its slices),
``parallelize`` / ``FsdpRequest`` (apply a layout to a model yourself: ``hf_dist.parallelism``),
``check_model_support`` (whether a model's config runs the layout of its arguments, before anything loads).
These are imported on first use, so the CLI and the pure planners start without transformers.
"""

from hf_dist.batch import BatchContract, scale_learning_rate
from hf_dist.parallel_dims import ParallelDims

__version__ = "0.1.0"

__all__ = [
    "BatchContract",
    "DistTrainer",
    "DistTrainingArguments",
    "FsdpRequest",
    "ParallelDims",
    "check_model_support",
    "from_pretrained",
    "parallelize",
    "scale_learning_rate",
    "__version__",
]


def __getattr__(name: str):
    if name in ("DistTrainer", "DistTrainingArguments"):
        from hf_dist import trainer

        return getattr(trainer, name)
    if name in ("parallelize", "FsdpRequest"):
        from hf_dist import parallelism

        return getattr(parallelism, name)
    if name == "from_pretrained":
        from hf_dist.trainer.pretrained import from_pretrained

        return from_pretrained
    if name == "check_model_support":
        from hf_dist.trainer.model_support import check_model_support

        return check_model_support
    raise AttributeError(f"module 'hf_dist' has no attribute {name!r}")

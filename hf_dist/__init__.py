"""hf_dist: take Hugging Face causal LMs from one GPU to many.

Public API: ``ParallelDims`` (the layout), ``BatchContract`` (global batch and LR scaling),
``DistTrainer`` / ``DistTrainingArguments`` (drop-in replacements for the HF Trainer classes),
``DistDPOTrainer`` / ``DistDPOConfig`` and ``DistGRPOTrainer`` / ``DistGRPOConfig`` (TRL's, with the same layouts;
need ``trl``),
``from_pretrained`` (a model loaded straight into the layout of its arguments, each rank reading its slices),
``parallelize`` / ``FsdpRequest`` (apply a layout to a model yourself: ``hf_dist.parallelism``),
``apply_layout`` / ``ApplyPlan`` (the same, pipelines included, as DistTrainer does it: ``hf_dist.apply``),
``model_refusals`` (why a model's config cannot run a layout: ``hf_dist.support``) and ``check_model_support``
(the same for the layout of training arguments, before anything loads).
These are imported on first use, so the CLI and the pure planners start without transformers.
"""

from hf_dist.batch import BatchContract, scale_learning_rate
from hf_dist.parallel_dims import ParallelDims

__version__ = "0.1.0"

__all__ = [
    "ApplyPlan",
    "BatchContract",
    "DistDPOConfig",
    "DistDPOTrainer",
    "DistGRPOConfig",
    "DistGRPOTrainer",
    "DistTrainer",
    "DistTrainingArguments",
    "FsdpRequest",
    "ParallelDims",
    "apply_layout",
    "check_model_support",
    "from_pretrained",
    "model_refusals",
    "parallelize",
    "scale_learning_rate",
    "__version__",
]


def __getattr__(name: str):
    if name in ("DistTrainer", "DistTrainingArguments"):
        from hf_dist import trainer

        return getattr(trainer, name)
    if name in ("DistDPOTrainer", "DistDPOConfig"):
        from hf_dist.trainer import dpo

        return getattr(dpo, name)
    if name in ("DistGRPOTrainer", "DistGRPOConfig"):
        from hf_dist.trainer import grpo

        return getattr(grpo, name)
    if name in ("parallelize", "FsdpRequest"):
        from hf_dist import parallelism

        return getattr(parallelism, name)
    if name in ("apply_layout", "ApplyPlan"):
        from hf_dist import apply

        return getattr(apply, name)
    if name == "model_refusals":
        from hf_dist.support import model_refusals

        return model_refusals
    if name == "from_pretrained":
        from hf_dist.trainer.pretrained import from_pretrained

        return from_pretrained
    if name == "check_model_support":
        from hf_dist.trainer.model_support import check_model_support

        return check_model_support
    raise AttributeError(f"module 'hf_dist' has no attribute {name!r}")

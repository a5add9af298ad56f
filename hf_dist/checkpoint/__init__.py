"""Sharded, atomic, reshardable training checkpoints (DCP underneath) and their export to the Hub format.

Public API: ``save_checkpoint`` / ``load_checkpoint`` (collective), ``AsyncCheckpointer``, ``ResumeState``,
``resume_batch_contract``, ``RetentionPolicy`` / ``apply_retention``, ``ResumableSampler`` /
``DataParallelBatchSampler``, ``CheckpointError``, ``checkpoint_kind`` (what wrote a folder). The Hub export is
``hf_dist.checkpoint.export.export_checkpoint``.
"""

from hf_dist.checkpoint.api import AsyncCheckpointer, SaveHandle, save_checkpoint
from hf_dist.checkpoint.kind import CheckpointKind, checkpoint_kind
from hf_dist.checkpoint.load import ResumeState, load_checkpoint, resume_batch_contract
from hf_dist.checkpoint.manifest import CheckpointError, Manifest, read_manifest, resolve_checkpoint
from hf_dist.checkpoint.retention import RetentionPolicy, apply_retention
from hf_dist.checkpoint.sampler import DataParallelBatchSampler, ResumableSampler

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointKind",
    "DataParallelBatchSampler",
    "Manifest",
    "ResumableSampler",
    "ResumeState",
    "RetentionPolicy",
    "SaveHandle",
    "apply_retention",
    "checkpoint_kind",
    "load_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
    "resume_batch_contract",
    "save_checkpoint",
]

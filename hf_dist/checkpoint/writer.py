"""Write a captured checkpoint into ``.<name>.partial`` and commit it atomically (collective over one group).

``save_checkpoint`` (``api``) captures everything a checkpoint holds at the moment of the save into a
``SaveJob``: the model/optimizer state dict (live for a synchronous save, a staged copy for an asynchronous
one), this rank's RNG states, and on rank 0 the scheduler/scaler state, the HF config texts, the tokenizer and
extra text files. ``write_and_commit`` then writes the job and commits it; it runs in the caller for a
synchronous save and in the background thread of an ``AsyncCheckpointer`` for an asynchronous one, so both
kinds go through the same steps: shards (DCP, fsynced), RNG, rank-0 files, an all-gathered error check, per-file
fsync and hashing, the manifest, the rename, the ``COMPLETE`` marker, and only then ``latest``.

Every collective here runs on ``group``: the background thread must never share a group with training.
Not here: what is captured (``api``), the background thread and staging buffers (``async_save``), loading.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.blocks import BlockSavePlanner
from hf_dist.checkpoint.retention import RetentionPolicy, apply_retention
from hf_dist.file_modes import save_safetensors

DCP_DIR, RNG_DIR, HF_DIR, TRAIN_STATE = "dcp", "rng", "hf", "train_state.pt"


@dataclass(kw_only=True)
class Rank0Files:
    """What rank 0 writes besides its shards, captured when the save was requested."""

    train_state: dict
    """``{"lr_scheduler": ..., "scaler": ...}`` state dicts (copies), saved as ``train_state.pt``."""
    config_json: str | None = None
    generation_json: str | None = None
    adapter_configs: dict[str, Any] = field(default_factory=dict)
    """PEFT adapter name -> a copy of its ``PeftConfig``."""
    tokenizer: Any = None
    extra_files: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class SaveJob:
    """One checkpoint, captured: writing it needs nothing from the training objects any more."""

    target: Path
    state: dict
    """``{"model": ..., "optimizer": ...}`` for DCP (a staged copy when saved asynchronously)."""
    rng: tuple[dict[str, torch.Tensor], dict[str, str]]
    """``safe_io.capture_rng()`` of this rank."""
    rank0: Rank0Files | None
    manifest: mf.Manifest
    hash_files: bool
    retention: RetentionPolicy | None

    @property
    def partial(self) -> Path:
        return self.target.with_name(f".{self.target.name}.partial")


def rank_world(group=None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def barrier(group=None) -> None:
    if rank_world(group)[1] > 1:
        dist.barrier(group=group)


def all_gather(obj, group=None) -> list:
    world = rank_world(group)[1]
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: that is the intent here.

    Only on the main thread: ``catch_warnings`` swaps the interpreter-wide filter list, which a background
    writer must not do while training runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write_and_commit(job: SaveJob, group=None, prior_error: str | None = None) -> mf.Manifest:
    """Write ``job`` into its partial directory and commit it (collective over ``group``).

    ``prior_error``: this rank failed before (staging); every rank raises it instead of writing.
    """
    rank, world = rank_world(group)
    error = prior_error
    try:
        if error is None:
            _prepare_partial(job.partial, rank)
    except Exception as err:  # every rank must learn it, or the others wait in the next collective forever
        error = f"preparing {job.partial} failed on rank {rank}: {err!r}"
    _raise_first_error(error, group, job)
    try:
        writer = dcp.FileSystemWriter(str(job.partial / DCP_DIR), sync_files=True)
        with quiet_single_process():
            dcp.save(job.state, storage_writer=writer, planner=BlockSavePlanner(), process_group=group,
                     no_dist=world == 1)
        _write_rank_files(job, rank)
    except Exception as err:
        error = f"writing {job.target} failed on rank {rank}: {err!r}"
    _raise_first_error(error, group, job)
    return _commit(job, rank, group)


def _raise_first_error(error: str | None, group, job: SaveJob) -> None:
    errors = [e for e in all_gather(error, group) if e]
    if errors:
        raise mf.CheckpointError(f"{errors[0]}; the checkpoint was not committed ({job.partial} is left)")


def _prepare_partial(partial: Path, rank: int) -> None:
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # a save that died before its commit
        (partial / DCP_DIR).mkdir(parents=True)
        (partial / RNG_DIR).mkdir()


def _write_rank_files(job: SaveJob, rank: int) -> None:
    tensors, meta = job.rng
    save_safetensors(tensors, job.partial / RNG_DIR / f"rank_{rank:05d}.safetensors", metadata=meta)
    if job.rank0 is not None:
        _write_rank0_files(job.partial, job.rank0)


def _write_rank0_files(partial: Path, files: Rank0Files) -> None:
    torch.save(files.train_state, partial / TRAIN_STATE)
    hf_dir = partial / HF_DIR
    hf_dir.mkdir(exist_ok=True)
    for adapter_name, config in files.adapter_configs.items():
        config.save_pretrained(str(hf_dir / "adapter" / adapter_name))
    if files.config_json is not None:
        (hf_dir / "config.json").write_text(files.config_json, encoding="utf-8")
    if files.generation_json is not None:
        (hf_dir / "generation_config.json").write_text(files.generation_json, encoding="utf-8")
    if files.tokenizer is not None:
        files.tokenizer.save_pretrained(str(hf_dir / "tokenizer"))
    for name, text in files.extra_files.items():
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        (partial / name).write_text(text, encoding="utf-8")


def _files_of_rank(partial: Path, rank: int) -> list[str]:
    rel = [f"{RNG_DIR}/rank_{rank:05d}.safetensors"]
    rel += [f"{DCP_DIR}/{p.name}" for p in (partial / DCP_DIR).glob(f"__{rank}_*")]
    if rank == 0:
        rel += [f"{DCP_DIR}/.metadata", TRAIN_STATE]
        rel += [
            p.relative_to(partial).as_posix()
            for p in partial.rglob("*")
            if p.is_file() and p.relative_to(partial).parts[0] not in (DCP_DIR, RNG_DIR, TRAIN_STATE)
        ]
    return rel


def _commit(job: SaveJob, rank: int, group) -> mf.Manifest:
    partial, manifest = job.partial, job.manifest
    files = _files_of_rank(partial, rank)
    for rel in files:
        mf.fsync_path(partial / rel)
    entries = all_gather(mf.describe_files(partial, files, rank=rank, hash_files=job.hash_files), group)
    manifest.files = [entry for rank_entries in entries for entry in rank_entries]
    if rank == 0:
        mf.write_text_durably(partial / mf.MANIFEST_NAME, manifest.to_json())
        for sub in [p for p in partial.rglob("*") if p.is_dir()]:
            mf.fsync_path(sub)  # directory entries of the shards, before the rename publishes them
        _replace_dir(partial, job.target)
        mf.commit_marker(job.target)
        mf.point_latest(job.target.parent, job.target.name)
        if job.retention is not None:
            apply_retention(job.target.parent, job.retention)
    barrier(group)
    return manifest


def _replace_dir(partial: Path, target: Path) -> None:
    aside = target.with_name(f".{target.name}.old")
    if aside.exists():
        shutil.rmtree(aside)
    if target.exists():
        target.rename(aside)  # `latest` may name it: the new one takes its name right below
    partial.rename(target)
    mf.fsync_path(target.parent)
    if aside.exists():
        shutil.rmtree(aside)

"""Save a training checkpoint of a DDP, FSDP2, TP, PP (or product) model, atomically.

``save_checkpoint`` is collective (every rank calls it). Model and optimizer go through
``torch.distributed.checkpoint`` (each rank writes its shards; DTensor/FSDP2/TP resharding on load is DCP's);
the LR scheduler and grad scaler go to ``train_state.pt`` (read back with ``weights_only=True``); each rank's
RNG to ``rng/rank_XXXXX.safetensors``; the HF config / tokenizer / adapter config to ``hf/``. Everything is
written into ``.<name>.partial`` next to the target, fsynced, committed by rename, then marked complete, and
only then does ``latest`` move.

Not here: loading (``load``), retention (``retention``), the data order (``sampler``), Hub export (``export``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from hf_dist.batch import BatchContract
from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.retention import RetentionPolicy, apply_retention
from hf_dist.checkpoint.safe_io import save_rng
from hf_dist.parallel_dims import ParallelDims

DCP_DIR, RNG_DIR, HF_DIR, TRAIN_STATE = "dcp", "rng", "hf", "train_state.pt"
_LAYOUT_FIELDS = ("world_size", "pp", "dp_replicate", "dp_shard", "tp")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _all_gather(obj) -> list:
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def layout_dict(layout: ParallelDims) -> dict:
    return {name: getattr(layout, name) for name in _LAYOUT_FIELDS}


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model under a DDP wrapper (FSDP2 and TP modify modules in place, so nothing to unwrap)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def fused_rows(model: torch.nn.Module) -> dict[str, dict]:
    """Parameters whose global rows TP stores rank-major (fused q/k/v or gate/up): ``{fqn: {parts, tp}}``."""
    try:
        from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR
    except ImportError:
        return {}
    out = {}
    for name, module in unwrap_model(model).named_modules():
        fused = getattr(module, FUSED_PARTS_ATTR, None)
        if fused is not None:
            for param_name, _ in module.named_parameters(recurse=False):
                out[f"{name}.{param_name}" if name else param_name] = {"parts": list(fused[0]), "tp": fused[1]}
    return out


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(unwrap_model(model), "peft_config")


class SaveHandle:
    """A checkpoint being written. ``result()`` (collective) waits for the shards, then commits atomically."""

    def __init__(self, *, target: Path, partial: Path, manifest: mf.Manifest, hash_files: bool, future=None,
                 retention=None):
        self.target, self._partial, self._manifest = target, partial, manifest
        self._hash_files, self._future, self._retention = hash_files, future, retention
        self._committed: mf.Manifest | None = None

    def done(self) -> bool:
        """True once the background write finished (``result()`` must still be called to commit)."""
        return self._future is None or self._future.done()

    def result(self) -> mf.Manifest:
        """Block until the shards are written, then commit (every rank must call this)."""
        if self._committed is None:
            error = None
            if self._future is not None:
                try:
                    self._future.result()
                except Exception as err:  # every rank must learn it, or the others wait in the commit forever
                    error = f"background write of {self.target} failed on rank {_rank_world()[0]}: {err!r}"
            errors = [e for e in _all_gather(error) if e]
            if errors:
                raise mf.CheckpointError(f"{errors[0]}; the checkpoint was not committed ({self._partial} is left)")
            self._committed = _commit(self.target, self._partial, self._manifest, self._hash_files, self._retention)
        return self._committed


# Optimizer state keyed per parameter (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): every entry has one
# owner, so pipeline stages that hold different parameters save and reload their param groups (unflattened,
# the one ``param_groups`` list would be kept from a single stage).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _model_and_optim_state(model, optimizer) -> dict:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_sd, "optimizer": optim_sd}


def _write_rank0_files(partial: Path, *, model, lr_scheduler, scaler, tokenizer) -> list[str]:
    contents = []
    train_state = {}
    if lr_scheduler is not None:
        train_state["lr_scheduler"] = lr_scheduler.state_dict()
        contents.append("lr_scheduler")
    if scaler is not None:
        train_state["scaler"] = scaler.state_dict()
        contents.append("scaler")
    torch.save(train_state, partial / TRAIN_STATE)
    inner = unwrap_model(model)
    hf_dir = partial / HF_DIR
    hf_dir.mkdir(exist_ok=True)
    if _is_peft(inner):
        for adapter_name, config in inner.peft_config.items():
            config.save_pretrained(str(hf_dir / "adapter" / adapter_name))
        contents.append("adapter_config")
        inner = inner.get_base_model()
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(str(hf_dir / "config.json"))
        contents.append("hf_config")
        generation = getattr(inner, "generation_config", None)
        if generation is not None:
            generation.to_json_file(str(hf_dir / "generation_config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(hf_dir / "tokenizer"))
        contents.append("tokenizer")
    return contents


def _write_extra_file(partial: Path, name: str, text: str) -> None:
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or rel.parts[0] in (DCP_DIR, RNG_DIR, HF_DIR, TRAIN_STATE, mf.MANIFEST_NAME):
        raise ValueError(f"extra_files name {name!r} must be a relative path outside dcp/, rng/, hf/ and the manifest")
    (partial / rel).parent.mkdir(parents=True, exist_ok=True)
    (partial / rel).write_text(text, encoding="utf-8")


def _prepare_partial(target: Path) -> Path:
    partial = target.with_name(f".{target.name}.partial")
    rank, _ = _rank_world()
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # a save that died before its commit
        (partial / DCP_DIR).mkdir(parents=True)
        (partial / RNG_DIR).mkdir()
    _barrier()
    return partial


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler=None,
    scaler=None,
    step: int,
    samples_consumed: int,
    layout: ParallelDims,
    batch_contract: BatchContract | None,
    extra: dict | None = None,
    metrics: dict[str, float] | None = None,
    tokenizer=None,
    extra_files: dict[str, str] | None = None,
    retention: RetentionPolicy | None = None,
    hash_files: bool = True,
    async_save: bool = False,
    async_group=None,
) -> SaveHandle:
    """Write a checkpoint of the run into ``directory`` (collective: call it on every rank).

    ``directory``'s parent gets a ``latest`` file naming it once it is complete. With ``async_save=True`` the
    call returns after the state is staged in CPU memory; call ``result()`` on the returned handle (on every
    rank, before the next save) to wait and commit. ``async_group``: a gloo group for the background write, so
    it does not share a group with training collectives (None: one is created). ``extra_files``: text files
    (relative name -> content) written by rank 0 into the checkpoint and committed with it (e.g. the HF
    ``trainer_state.json``). ``retention``: applied to ``directory``'s parent after the commit (rank 0).
    """
    rank, world = _rank_world()
    if layout.world_size != world:
        raise ValueError(
            f"layout.world_size={layout.world_size} but the process group has {world} ranks; pass the ParallelDims "
            f"this run was built with"
        )
    if batch_contract is not None and batch_contract.world_size != world:
        raise ValueError(f"batch_contract.world_size={batch_contract.world_size} but the process group has {world}")
    if step < 0 or samples_consumed < 0:
        raise ValueError(f"step={step} and samples_consumed={samples_consumed} must be non-negative")
    target = Path(directory)
    partial = _prepare_partial(target)
    state = _model_and_optim_state(model, optimizer)
    writer = dcp.FileSystemWriter(str(partial / DCP_DIR), sync_files=True)
    future = None
    if async_save:
        if async_group is None and world > 1:
            async_group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, storage_writer=writer, process_group=async_group, no_dist=world == 1)
        if not isinstance(future, Future):  # AsyncSaveResponse (zero-overhead stagers)
            future = future.upload_completion
    else:
        with _quiet_single_process():
            dcp.save(state, storage_writer=writer, no_dist=world == 1)
    save_rng(partial / RNG_DIR / f"rank_{rank:05d}.safetensors")
    contents = ["model"] + (["optimizer"] if optimizer is not None else []) + ["rng"]
    if rank == 0:
        contents += _write_rank0_files(partial, model=model, lr_scheduler=lr_scheduler, scaler=scaler, tokenizer=tokenizer)
        for name, text in (extra_files or {}).items():
            _write_extra_file(partial, name, text)
    manifest = mf.Manifest(
        step=step,
        samples_consumed=samples_consumed,
        world_size=world,
        layout=layout_dict(layout),
        batch_contract=None if batch_contract is None else batch_contract.as_dict(),
        contents=contents,
        metrics=dict(metrics or {}),
        extra=dict(extra or {}),
        model_kind="peft" if _is_peft(model) else "causal_lm",
        fused_rows=fused_rows(model),
    )
    handle = SaveHandle(target=target, partial=partial, manifest=manifest, hash_files=hash_files, future=future,
                        retention=retention)
    if not async_save:
        handle.result()
    return handle


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


def _commit(target: Path, partial: Path, manifest: mf.Manifest, hash_files: bool, retention) -> mf.Manifest:
    rank, _ = _rank_world()
    files = _files_of_rank(partial, rank)
    for rel in files:
        mf.fsync_path(partial / rel)
    entries = _all_gather(mf.describe_files(partial, files, rank=rank, hash_files=hash_files))
    manifest.files = [entry for rank_entries in entries for entry in rank_entries]
    if rank == 0:
        mf.write_text_durably(partial / mf.MANIFEST_NAME, manifest.to_json())
        for sub in [p for p in partial.rglob("*") if p.is_dir()]:
            mf.fsync_path(sub)  # directory entries of the shards, before the rename publishes them
        _replace_dir(partial, target)
        mf.commit_marker(target)
        mf.point_latest(target.parent, target.name)
        if retention is not None:
            apply_retention(target.parent, retention)
    _barrier()
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

"""Save a training checkpoint of a DDP, FSDP2, TP, PP (or product) model, atomically.

``save_checkpoint`` is collective (every rank calls it). Model and optimizer go through
``torch.distributed.checkpoint`` (each rank writes its shards; DTensor/FSDP2/TP resharding on load is DCP's; a
shard that is several blocks of its tensor, MoE experts' ``[gate_r | up_r]`` under TP, block by block: ``blocks``);
the LR scheduler and grad scaler go to ``train_state.pt`` (read back with ``weights_only=True``); each rank's
RNG to ``rng/rank_XXXXX.safetensors``; the HF config / tokenizer / adapter config to ``hf/``. Everything is
written into ``.<name>.partial`` next to the target, fsynced, committed by rename, then marked complete, and
only then does ``latest`` move (``writer``). An asynchronous save (``async_save=AsyncCheckpointer()``) captures
the same things, copies the state into cached buffers and returns; the writing and the commit run in the
checkpointer's thread (``async_save``).

Not here: loading (``load``), retention (``retention``), the data order (``sampler``), Hub export (``export``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from hf_dist.batch import BatchContract
from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.async_save import AsyncCheckpointer
from hf_dist.checkpoint.retention import RetentionPolicy
from hf_dist.checkpoint.safe_io import capture_rng
from hf_dist.checkpoint.writer import (
    DCP_DIR,
    HF_DIR,
    RNG_DIR,
    TRAIN_STATE,
    Rank0Files,
    SaveJob,
    rank_world,
    write_and_commit,
)
from hf_dist.models.peft_utils import is_peft_model, unwrap_peft
from hf_dist.parallel_dims import ParallelDims
from hf_dist.strategy import Layout

__all__ = ["DCP_DIR", "HF_DIR", "RNG_DIR", "TRAIN_STATE", "AsyncCheckpointer", "SaveHandle", "save_checkpoint"]
_LAYOUT_FIELDS = ("world_size", "pp", "dp_replicate", "dp_shard", "tp", "ep")


def layout_dict(layout: ParallelDims | Layout) -> dict:
    """The manifest's ``layout``: the mesh factors, and for a run's ``Layout`` its name and description."""
    if isinstance(layout, Layout):
        dims = layout.dims
        return {name: getattr(dims, name) for name in _LAYOUT_FIELDS} | {"name": layout.name,
                                                                         "description": layout.describe()}
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
    return is_peft_model(unwrap_model(model))


class SaveHandle:
    """A checkpoint being written. ``result()`` waits until it is committed and returns its manifest."""

    def __init__(self, *, target: Path, manifest: mf.Manifest | None = None, future: Future | None = None,
                 staged: Future | None = None):
        self.target, self._manifest, self._future, self._staged = target, manifest, future, staged

    def wait_staged(self) -> None:
        """Block until the state is copied (only ``stage_in_background`` saves return before that).

        After this the parameters and optimizer state may change. ``optimizer.step`` waits by itself.
        """
        if self._staged is not None:
            self._staged.result()

    def done(self) -> bool:
        """True once the checkpoint is committed (or its background write failed)."""
        return self._future is None or self._future.done()

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the checkpoint is committed or failed (now, if it is; else in the writer thread)."""
        if self._future is None:
            fn()
        else:
            self._future.add_done_callback(lambda _: fn())

    def result(self) -> mf.Manifest:
        """Block until committed. A background write that failed raises here: ``CheckpointError`` on every rank
        when a shard or file could not be written, or the commit's own error on the rank that hit it."""
        if self._manifest is None:
            self._manifest = self._future.result()
        return self._manifest


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


def _capture_rank0_files(model, *, lr_scheduler, scaler, tokenizer, extra_files) -> tuple[Rank0Files, list[str]]:
    """Rank 0's files as they are now (copies), so a background write sees nothing of later steps."""
    files, contents = Rank0Files(train_state={}, tokenizer=tokenizer, extra_files=dict(extra_files or {})), []
    if lr_scheduler is not None:
        files.train_state["lr_scheduler"] = copy.deepcopy(lr_scheduler.state_dict())
        contents.append("lr_scheduler")
    if scaler is not None:
        files.train_state["scaler"] = copy.deepcopy(scaler.state_dict())
        contents.append("scaler")
    inner = unwrap_model(model)
    if _is_peft(inner):
        files.adapter_configs = {name: copy.deepcopy(config) for name, config in inner.peft_config.items()}
        contents.append("adapter_config")
        inner = unwrap_peft(inner)
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        files.config_json = config.to_json_string()
        contents.append("hf_config")
        generation = getattr(inner, "generation_config", None)
        if generation is not None:
            files.generation_json = generation.to_json_string()
    if tokenizer is not None:
        contents.append("tokenizer")
    return files, contents


def _check_extra_files(extra_files: dict[str, str] | None) -> None:
    for name in extra_files or {}:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or rel.parts[0] in (DCP_DIR, RNG_DIR, HF_DIR, TRAIN_STATE,
                                                                       mf.MANIFEST_NAME):
            raise ValueError(f"extra_files name {name!r} must be a relative path outside dcp/, rng/, hf/ and the "
                             f"manifest")


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler=None,
    scaler=None,
    step: int,
    samples_consumed: int,
    layout: ParallelDims | Layout,
    batch_contract: BatchContract | None,
    extra: dict | None = None,
    metrics: dict[str, float] | None = None,
    tokenizer=None,
    extra_files: dict[str, str] | None = None,
    retention: RetentionPolicy | None = None,
    hash_files: bool = True,
    async_save: bool | AsyncCheckpointer = False,
) -> SaveHandle:
    """Write a checkpoint of the run into ``directory`` (collective: call it on every rank).

    ``directory``'s parent gets a ``latest`` file naming it once it is complete. ``async_save``: an
    ``AsyncCheckpointer`` (reused across saves: the call returns after a copy into its cached buffers, and its
    writer thread writes and commits), or ``True`` for a one-off one (a new gloo group and new buffers for this
    save). ``result()`` on the returned handle waits for the commit. ``extra_files``: text files (relative name ->
    content) written by rank 0 into the checkpoint and committed with it (e.g. the HF ``trainer_state.json``).
    ``retention``: applied to ``directory``'s parent after the commit (rank 0).
    """
    rank, world = rank_world()
    _check_save_inputs(layout, batch_contract, world, step, samples_consumed, extra_files)
    saver = AsyncCheckpointer() if async_save is True else async_save or None
    state = _model_and_optim_state(model, optimizer)
    contents = ["model"] + (["optimizer"] if optimizer is not None else []) + ["rng"]
    rank0 = None
    if rank == 0:
        rank0, rank0_contents = _capture_rank0_files(model, lr_scheduler=lr_scheduler, scaler=scaler,
                                                     tokenizer=tokenizer, extra_files=extra_files)
        contents += rank0_contents
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
    job = SaveJob(target=Path(directory), state=state, rng=capture_rng(), rank0=rank0, manifest=manifest,
                  hash_files=hash_files, retention=retention)
    if saver is None:
        return SaveHandle(target=job.target, manifest=write_and_commit(job))
    future, staged = saver.submit(job)  # staged in the caller unless stage_in_background
    if optimizer is not None and not staged.done():
        _wait_before_next_step(optimizer, staged)
    if async_save is True:
        saver.close(wait=False)
    return SaveHandle(target=job.target, future=future, staged=staged)


def _wait_before_next_step(optimizer: torch.optim.Optimizer, staged: Future) -> None:
    """A one-shot ``optimizer.step`` pre-hook: the step waits until the state being saved is copied."""
    hook = None

    def wait(*_) -> None:
        hook.remove()
        staged.result()

    hook = optimizer.register_step_pre_hook(wait)


def _check_save_inputs(layout, batch_contract, world: int, step: int, samples_consumed: int, extra_files) -> None:
    if layout.world_size != world:
        raise ValueError(
            f"layout.world_size={layout.world_size} but the process group has {world} ranks; pass the ParallelDims "
            f"this run was built with"
        )
    if batch_contract is not None and batch_contract.world_size != world:
        raise ValueError(f"batch_contract.world_size={batch_contract.world_size} but the process group has {world}")
    if step < 0 or samples_consumed < 0:
        raise ValueError(f"step={step} and samples_consumed={samples_consumed} must be non-negative")
    _check_extra_files(extra_files)

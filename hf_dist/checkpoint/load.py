"""Load a checkpoint written by ``save_checkpoint`` into any layout (collective), verified before any read.

The manifest and every file's size (or hash) are checked first, on every rank, and a problem found by any rank
is raised on all of them (no rank is left waiting in a collective). DCP then reads each rank's slice of every
tensor, so the saving and loading layouts may differ (world size, DDP/FSDP2/TP/PP). Per-rank RNG is restored
only on the same world size.

Not here: writing (``api``), Hub export (``export``).
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict

from hf_dist.batch import BatchContract
from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.api import _OPTIONS, DCP_DIR, RNG_DIR, TRAIN_STATE, _model_and_optim_state, fused_rows
from hf_dist.checkpoint.writer import all_gather as _all_gather
from hf_dist.checkpoint.writer import quiet_single_process as _quiet_single_process
from hf_dist.checkpoint.writer import rank_world as _rank_world
from hf_dist.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, restore_rng
from hf_dist.parallel_dims import ParallelDims

@dataclass(kw_only=True)
class ResumeState:
    """What ``load_checkpoint`` restored, and where training continues."""

    path: Path
    """The checkpoint directory that was loaded."""
    step: int
    """Optimizer steps already taken."""
    samples_consumed: int
    """Global samples already consumed: the data position to continue from."""
    saved_layout: dict
    """The ``ParallelDims`` factors of the run that wrote the checkpoint."""
    saved_batch_contract: BatchContract | None
    """The batch contract of that run (None if it had none)."""
    rng_restored: bool
    """False when the world size changed (per-rank RNG cannot be mapped) or ``restore_rng=False``."""
    metrics: dict = field(default_factory=dict)
    """Metrics recorded with the checkpoint."""
    extra: dict = field(default_factory=dict)
    """User data recorded with the checkpoint."""



def _check_fused_rows(ckpt: Path, saved: dict, model: torch.nn.Module) -> None:
    """Rank-major fused rows only load into the same tensor-parallel degree (DCP would not reorder them)."""
    current = fused_rows(model)
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key, {}).get("tp", 1), current.get(key, {}).get("tp", 1)
        if before != after:
            raise ValueError(
                f"{key} is a fused projection stored rank-major for tp={before} in {ckpt} but the model has tp={after}; "
                f"resume it with tp={before}, or export it (hf-dist checkpoint export) and start from the HF weights"
            )



def _agree(error: str | None) -> None:
    """Raise the same ``CheckpointError`` on every rank if any rank found a problem (no rank hangs)."""
    errors = [e for e in _all_gather(error) if e]
    if errors:
        raise mf.CheckpointError(errors[0])


def _verify(ckpt: Path, verify: mf.VerifyMode) -> mf.Manifest:
    error, manifest = None, None
    try:
        manifest = mf.read_manifest(ckpt)
        mf.verify_files(ckpt, manifest, verify)
        SafeFileSystemReader(str(ckpt / DCP_DIR)).read_metadata()  # refuse foreign pickles before DCP does
    except mf.CheckpointError as err:
        error = str(err)
    except (pickle.UnpicklingError, FileNotFoundError) as err:
        error = f"{ckpt / DCP_DIR / '.metadata'} cannot be read safely: {err}"
    _agree(error)
    return manifest


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler=None,
    scaler=None,
    restore_rng: bool = True,
    verify: mf.VerifyMode = "size",
    strict: bool = True,
) -> ResumeState:
    """Load a checkpoint (or the one ``path/latest`` names) into the current layout (collective).

    The model and optimizer may be laid out differently from the saving run (other world size, DDP/FSDP2/TP):
    DCP reads each rank's slice of every tensor. Per-rank RNG is restored only on the same world size.
    """
    ckpt = mf.resolve_checkpoint(path)
    manifest = _verify(ckpt, verify)
    if optimizer is not None and "optimizer" not in manifest.contents:
        raise ValueError(
            f"{ckpt} holds no optimizer state (contents: {', '.join(manifest.contents)}); pass optimizer=None to "
            f"load the model only and start the optimizer fresh"
        )
    _check_fused_rows(ckpt, manifest.fused_rows, model)
    state = _model_and_optim_state(model, optimizer)
    with _quiet_single_process():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(ckpt / DCP_DIR)),
            planner=SafeLoadPlanner(allow_partial_load=not strict),
            no_dist=_rank_world()[1] == 1,
        )
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_OPTIONS)
    _load_train_state(ckpt, manifest, lr_scheduler=lr_scheduler, scaler=scaler)
    rng_restored = _maybe_restore_rng(ckpt, manifest, restore_rng)
    contract = manifest.batch_contract
    return ResumeState(
        path=ckpt,
        step=manifest.step,
        samples_consumed=manifest.samples_consumed,
        saved_layout=manifest.layout,
        saved_batch_contract=None if contract is None else BatchContract(**contract),
        rng_restored=rng_restored,
        metrics=manifest.metrics,
        extra=manifest.extra,
    )


def _load_train_state(ckpt: Path, manifest: mf.Manifest, *, lr_scheduler, scaler) -> None:
    train_state = torch.load(ckpt / TRAIN_STATE, weights_only=True)
    for name, obj in (("lr_scheduler", lr_scheduler), ("scaler", scaler)):
        if obj is None:
            continue
        if name not in train_state:
            raise ValueError(f"{ckpt} holds no {name} state; pass {name}=None to start it fresh")
        state = train_state[name]
        if name == "lr_scheduler":
            state = _fit_param_groups(state, obj, ckpt)
        obj.load_state_dict(state)


def _fit_param_groups(state: dict, lr_scheduler, ckpt: Path) -> dict:
    """The saved scheduler state for this run's number of optimizer param groups.

    The group count is a property of the layout, not of the schedule: the Trainer gives each device mesh its own
    group (expert shards under EP live on another mesh than the dense parameters), so an EP run saves 3 groups and
    one process has 2. Per-group lists whose saved entries are all equal are repeated to the new count; groups
    that differ cannot be matched up and are refused."""
    optimizer = getattr(lr_scheduler, "optimizer", None)
    saved = len(state.get("base_lrs") or ())
    groups = len(optimizer.param_groups) if optimizer is not None else saved
    if not saved or groups == saved:
        return state
    fitted = dict(state)
    for key, value in state.items():
        if not (isinstance(value, list) and len(value) == saved):
            continue
        if any(v != value[0] for v in value):
            raise ValueError(f"{ckpt}: its lr_scheduler has {saved} param groups with different {key} ({value}) and "
                             f"this run's optimizer has {groups}; the groups cannot be matched: resume on the saving "
                             f"layout, or pass lr_scheduler=None and set the schedule yourself")
        fitted[key] = [value[0]] * groups
    return fitted


def _maybe_restore_rng(ckpt: Path, manifest: mf.Manifest, restore: bool) -> bool:
    rank, world = _rank_world()
    if not restore:
        return False
    if manifest.world_size != world:
        if rank == 0:
            warnings.warn(
                f"{ckpt} was saved by {manifest.world_size} ranks and is loaded by {world}: per-rank RNG states are "
                f"not restored (random streams such as dropout continue from the current seeds)",
                stacklevel=3,
            )
        return False
    restore_rng(ckpt / RNG_DIR / f"rank_{rank:05d}.safetensors")
    return True


def resume_batch_contract(saved: BatchContract, layout: ParallelDims) -> BatchContract:
    """The saved global batch on a new layout: accumulation re-derived for the new dp degree.

    ``ValueError`` (from ``BatchContract``) when the global batch does not divide over the new layout.
    """
    return BatchContract(**{**saved.as_dict(), "world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp})

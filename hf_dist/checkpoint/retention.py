"""Which checkpoints to keep: the last K, plus the best by a metric — never deleting the only complete one.

Pure selection (``select_to_delete``) is separate from the deletion (``apply_retention``, rank 0 only), so the
policy is testable without files. Incomplete directories (a save that died) are not checkpoints: they are
removed when older than the newest complete checkpoint.

Not here: writing checkpoints (``hf_dist.checkpoint.api``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.kind import checkpoint_kind


@dataclass(kw_only=True, frozen=True)
class RetentionPolicy:
    """What to keep under a checkpoint root."""

    keep_last: int | None = None
    """Keep the K most recent complete checkpoints (None: keep all)."""
    best_metric: str | None = None
    """Also keep the checkpoint with the best value of this metric (from ``save_checkpoint(metrics=...)``)."""
    mode: Literal["min", "max"] = "min"
    """Whether lower (``min``) or higher (``max``) ``best_metric`` is better."""
    protect: tuple[str, ...] = ()
    """Checkpoint names never deleted (e.g. the Trainer's best checkpoint)."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValueError(f"keep_last={self.keep_last!r} must be a positive integer (or None to keep all)")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode={self.mode!r} must be 'min' or 'max'")


def select_to_delete(
    checkpoints: list[tuple[str, int, dict]], policy: RetentionPolicy, *, latest: str | None = None
) -> list[str]:
    """Names to delete from ``(name, step, metrics)`` of complete checkpoints.

    Keeps the newest ``keep_last``, the best by ``best_metric``, and whatever ``latest`` names; never returns
    every checkpoint, so at least one complete checkpoint always survives.
    """
    if policy.keep_last is None or not checkpoints:
        return []
    ordered = sorted(checkpoints, key=lambda c: (c[1], c[0]))
    keep = {name for name, _, _ in ordered[-policy.keep_last :]}
    if latest is not None:
        keep.add(latest)
    if policy.best_metric is not None:
        scored = [(m[policy.best_metric], name) for name, _, m in ordered if policy.best_metric in m]
        if scored:
            best = min(scored) if policy.mode == "min" else max(scored)
            keep.add(best[1])
    doomed = [name for name, _, _ in ordered if name not in keep]
    return doomed if len(doomed) < len(ordered) else doomed[:-1]


def apply_retention(root: str | Path, policy: RetentionPolicy, *, protect: tuple[str, ...] = ()) -> list[str]:
    """Delete what ``policy`` does not keep under ``root`` (call on one rank). Returns the names deleted.

    ``protect``: names never deleted, besides ``policy.protect``.
    """
    root = Path(root)
    complete = mf.complete_checkpoints(root)
    latest_file = root / mf.LATEST_NAME
    latest = latest_file.read_text(encoding="utf-8").strip() if latest_file.is_file() else None
    entries = []
    for path in complete:
        manifest = mf.read_manifest(path)
        entries.append((path.name, manifest.step, manifest.metrics))
    doomed = [name for name in select_to_delete(entries, policy, latest=latest) if name not in protect + policy.protect]
    if entries:
        doomed += _dead_saves(root, newest_step=max(step for _, step, _ in entries), latest=latest)
    for name in doomed:
        shutil.rmtree(root / name)
    return doomed


def _dead_saves(root: Path, *, newest_step: int, latest: str | None) -> list[str]:
    """Checkpoint folders whose save died between the rename and the marker, older than a complete one."""
    dead = []
    for child in sorted(root.iterdir()):
        manifest = child / mf.MANIFEST_NAME
        if (child.name.startswith(".") or child.name == latest or checkpoint_kind(child) != "hf_dist"
                or mf.is_complete(child)):
            continue
        try:
            step = json.loads(manifest.read_text(encoding="utf-8"))["step"]
        except (ValueError, KeyError):
            continue  # not a manifest we wrote: leave it alone
        if step < newest_step:
            dead.append(child.name)
    return dead

"""The checkpoint manifest, the completion marker, the ``latest`` pointer and file verification.

A checkpoint directory is complete when it holds ``manifest.json`` and a ``COMPLETE`` marker whose content is
the SHA-256 of that manifest. The manifest lists every file with its size (and SHA-256 when hashing is on),
the training step, the data position, the layout and the batch contract. Loading checks the marker, then every
listed file, before any tensor is read: a truncated or missing shard is an error naming the file.

Not here: writing tensors (``hf_dist.checkpoint.api``) or deciding what to keep (``retention``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
COMPLETE_NAME = "COMPLETE"
LATEST_NAME = "latest"
VerifyMode = Literal["none", "size", "sha256"]


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, damaged, or does not match what is being loaded into."""


@dataclass(kw_only=True)
class FileEntry:
    """One file of a checkpoint, relative to the checkpoint directory."""

    path: str
    """POSIX path relative to the checkpoint directory."""
    size: int
    """Size in bytes when written."""
    sha256: str | None = None
    """Hex digest when the checkpoint was saved with hashing, else None (size is still checked)."""
    rank: int = 0
    """The rank that wrote (and hashed) the file."""


@dataclass(kw_only=True)
class Manifest:
    """What a checkpoint holds; serialised as ``manifest.json``."""

    step: int
    """Optimizer steps taken when the checkpoint was written."""
    samples_consumed: int
    """Global samples (sequences) consumed by training, across all data-parallel ranks."""
    world_size: int
    """Processes that wrote the checkpoint."""
    layout: dict
    """``ParallelDims`` factors: ``world_size, pp, dp_replicate, dp_shard, tp``."""
    batch_contract: dict | None
    """``BatchContract.as_dict()`` of the run, or None when the run had no contract."""
    contents: list[str]
    """What is inside: any of ``model, optimizer, lr_scheduler, scaler, rng, hf_config, tokenizer, adapter_config``."""
    files: list[FileEntry] = field(default_factory=list)
    """Every file of the checkpoint except the manifest and the marker."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Evaluation metrics at this step (best-by-metric retention reads them)."""
    extra: dict = field(default_factory=dict)
    """JSON-serialisable user data."""
    fused_rows: dict = field(default_factory=dict)
    """Fused projections stored rank-major by tensor parallelism: ``{param: {"parts": [...], "tp": n}}``."""
    model_kind: str = "causal_lm"
    """``causal_lm`` or ``peft`` (a PEFT-wrapped model; export can write the adapter or merge it)."""
    format_version: int = FORMAT_VERSION
    """Manifest format version."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> "Manifest":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{source} is not valid JSON ({err}); the checkpoint is damaged") from err
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format_version={raw.get('format_version')!r}; this hf_dist reads {FORMAT_VERSION}"
            )
        raw["files"] = [FileEntry(**entry) for entry in raw.get("files", [])]
        return cls(**raw)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_files(root: Path, relative_paths: list[str], *, rank: int, hash_files: bool) -> list[FileEntry]:
    """Size (and hash) of the files a rank wrote, for the manifest."""
    entries = []
    for rel in sorted(relative_paths):
        full = root / rel
        entries.append(
            FileEntry(path=rel, size=full.stat().st_size, sha256=sha256_of(full) if hash_files else None, rank=rank)
        )
    return entries


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk (directories: so that a rename survives a power loss)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling, fsync, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def is_complete(ckpt_dir: Path) -> bool:
    """True when the marker exists and matches the manifest (cheap: no shard is read)."""
    marker, manifest = ckpt_dir / COMPLETE_NAME, ckpt_dir / MANIFEST_NAME
    if not marker.is_file() or not manifest.is_file():
        return False
    return marker.read_text(encoding="utf-8").strip() == sha256_of(manifest)


def read_manifest(ckpt_dir: Path) -> Manifest:
    """The manifest of a complete checkpoint; ``CheckpointError`` naming what is missing otherwise."""
    manifest_path = ckpt_dir / MANIFEST_NAME
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: {ckpt_dir} is not a complete hf_dist checkpoint")
    if not is_complete(ckpt_dir):
        raise CheckpointError(
            f"{ckpt_dir / COMPLETE_NAME} is missing or does not match {manifest_path}: the save of {ckpt_dir} did not "
            f"finish (or the manifest was edited); resume from an earlier checkpoint ({ckpt_dir.parent / LATEST_NAME})"
        )
    return Manifest.from_json(manifest_path.read_text(encoding="utf-8"), source=str(manifest_path))


def verify_files(ckpt_dir: Path, manifest: Manifest, mode: VerifyMode = "size", prefix: str = "") -> None:
    """Check that every listed file (under ``prefix``) exists with its recorded size, and hash when asked."""
    if mode not in ("none", "size", "sha256"):
        raise ValueError(f"verify={mode!r} is not a verification mode; use 'none', 'size' or 'sha256'")
    if mode == "none":
        return
    for entry in manifest.files:
        if not entry.path.startswith(prefix):
            continue
        full = ckpt_dir / entry.path
        if not full.is_file():
            raise CheckpointError(f"checkpoint file {full} is missing (listed in {ckpt_dir / MANIFEST_NAME})")
        size = full.stat().st_size
        if size != entry.size:
            raise CheckpointError(
                f"checkpoint file {full} has {size} bytes but the manifest records {entry.size}: it is truncated or "
                f"was overwritten; restore it or resume from an earlier checkpoint"
            )
        if mode == "sha256" and entry.sha256 is not None and sha256_of(full) != entry.sha256:
            raise CheckpointError(f"checkpoint file {full} does not match its SHA-256 in the manifest: it is corrupt")


def commit_marker(ckpt_dir: Path) -> None:
    write_text_durably(ckpt_dir / COMPLETE_NAME, sha256_of(ckpt_dir / MANIFEST_NAME) + "\n")


def point_latest(root: Path, name: str) -> None:
    """Make ``root/latest`` name the complete checkpoint ``root/name`` (atomic replace)."""
    if not is_complete(root / name):
        raise CheckpointError(f"refusing to point {root / LATEST_NAME} at incomplete checkpoint {root / name}")
    write_text_durably(root / LATEST_NAME, name + "\n")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from either itself or its parent (through ``latest``)."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists() or (path / COMPLETE_NAME).exists():
        return path
    latest = path / LATEST_NAME
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{latest} holds {name!r}, which is not a checkpoint name in {path}")
        return path / name
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST_NAME}) nor a folder with a {LATEST_NAME} file")


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints directly under ``root``, oldest step first."""
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        if child.is_dir() and not child.name.startswith(".") and is_complete(child):
            found.append((read_manifest(child).step, child.name, child))
    return [path for _, _, path in sorted(found)]

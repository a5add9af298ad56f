"""The output side of every export: the folder prepared, the weights written by the Hub writer, the report.

Shared by all exporters (``dcp``, ``lora``, ``native``, ``hf_dist.checkpoint.zero``): what an export wrote
(``ExportReport``), the refusal to mix a new export with an old one (``prepare_out``), the weights written through
``hf_dist.hub_writer.write_weights`` (``write_model_weights``) and the logits comparison of ``verify="logits"``.

Not here: reading any checkpoint kind (the exporters), verifying tensors (``verify``, ``lora_verify``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_dist.checkpoint import manifest as mf
from hf_dist.hub_writer import INDEX_NAME, MODEL_FILES, Entries, write_weights


@dataclass(kw_only=True)
class ExportReport:
    """What an export wrote and how it checked."""

    out_dir: Path
    """The folder written."""
    files: list[str] = field(default_factory=list)
    """Files written (relative to ``out_dir``)."""
    total_bytes: int = 0
    """Bytes of tensor data written."""
    largest_shard_bytes: int = 0
    """Tensor bytes of the largest output shard: about the peak memory of the export."""
    verification: str = "none"
    """Which check ran: ``'tensors'`` (structure + every tensor, bounded memory), ``'logits'`` or ``'none'``."""
    tensors_verified: int | None = None
    """Exported tensors found equal to the checkpoint's (``verification='tensors'``)."""
    max_logit_diff: float | None = None
    """Largest |logit difference| between the export and the checkpoint on the probe batch (``'logits'`` only)."""
    checksums_verified: int | None = None
    """Checkpoint files whose SHA-256 matched the manifest before anything was read (None: it records none)."""


def write_model_weights(
    out: Path,
    entries: Entries,
    produce: Callable[[list[str]], dict[str, torch.Tensor]],
    max_shard_size: int | str | None,
    report: ExportReport,
    *,
    filename_pattern: str = MODEL_FILES,
) -> None:
    """The model's weights into ``out`` through ``hf_dist.hub_writer`` (``produce(names)``: one output shard's tensors,
    so about one shard is in memory), recorded in ``report``. ``max_shard_size``, ``filename_pattern``: as
    ``hf_dist.hub_writer.plan_shards``'s."""
    written = write_weights(out, entries, produce, max_shard_size=max_shard_size, filename_pattern=filename_pattern)
    report.files += written.files
    report.total_bytes += written.total_bytes
    report.largest_shard_bytes = max(report.largest_shard_bytes, written.largest_shard_bytes)


# What an export writes besides config/tokenizer files (those are overwritten by name). With ``overwrite``, these
# are removed first, so that a previous export's shards or index cannot mix with the new ones; nothing else is.
WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", INDEX_NAME, "adapter_model.safetensors",
                   "adapter_config.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def prepare_out(out: Path, overwrite: bool) -> None:
    """A folder to export into: new or empty, or (``overwrite``) with its previous model files removed."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file, not a folder; pass a new or empty folder to export into")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"output folder {out} is not empty; choose a new folder, or pass overwrite=True "
                             f"(--overwrite) to replace the model files in it (other files are kept)")
        for pattern in WEIGHT_PATTERNS:
            for stale in out.glob(pattern):
                stale.unlink()
    out.mkdir(parents=True, exist_ok=True)


def probe_batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def compare_logits(reference, exported, vocab_size: int, atol: float, what: str) -> float:
    probe = probe_batch(vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=probe).logits.float()
        got = exported(input_ids=probe).logits.float()
    diff = (expected - got).abs().max().item()
    if diff > atol:
        raise mf.CheckpointError(f"{what}: logits differ from the checkpoint by {diff:.3g} (> {atol:g}); not exported correctly")
    return diff

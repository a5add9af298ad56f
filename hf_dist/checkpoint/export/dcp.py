"""Export an hf_dist (DCP) training checkpoint of any layout to a Hub-ready folder, one output shard at a time.

The output is what ``save_pretrained`` writes: ``model-0000k-of-0000n.safetensors`` + index, ``config.json``,
``generation_config.json`` and the tokenizer. Every checkpoint file is first checked against its SHA-256 in the
manifest. The shard plan comes from the DCP metadata alone (global shapes and dtypes, through hf_dist's Hub writer,
``hf_dist.hub_writer``); each shard's tensors are then read from the DCP files by key, written, and dropped, so
the export itself holds about one shard in memory. Verification (``verify``) then checks, by default, the
folder's structure on ``meta`` and every exported tensor against the DCP checkpoint, one tensor at a time;
``verify="logits"`` compares logits of two whole models instead (~2x the model in RAM). The helpers that read DCP
files are shared with ``lora``.

Not here: LoRA adapters (``lora``), ZeRO checkpoints (``zero``), Trainer-native ones (``native``).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.api import DCP_DIR, HF_DIR
from hf_dist.checkpoint.export.folder import ExportReport, compare_logits, prepare_out, write_model_weights
from hf_dist.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner

MODEL_PREFIX = "model."


def tensor_metadata(ckpt: Path) -> dict[str, TensorStorageMetadata]:
    """Global tensor metadata of the model entries, by their name in the model (DCP ``model.`` prefix removed)."""
    metadata = SafeFileSystemReader(str(ckpt / DCP_DIR)).read_metadata()
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            out[key[len(MODEL_PREFIX) :]] = meta
    return out


def check_complete_tensor(name: str, meta: TensorStorageMetadata) -> None:
    """Refuse a tensor that is empty or whose saved chunks do not cover its global shape (one rank's shard)."""
    numel = meta.size.numel()
    if numel == 0:
        raise mf.CheckpointError(f"tensor {name} has shape {tuple(meta.size)}: it is empty (a ZeRO-3/FSDP placeholder)")
    covered = sum(torch.Size(chunk.sizes).numel() for chunk in meta.chunks)
    if covered != numel:
        raise mf.CheckpointError(
            f"tensor {name} of shape {tuple(meta.size)} has saved chunks covering {covered} of {numel} elements: it "
            f"holds one rank's shard only"
        )


def hf_order(tensors: dict[str, torch.Tensor], fused: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Fused projections saved rank-major by tensor parallelism, back in HF row order."""
    if not fused:
        return tensors
    from hf_dist.tensor_parallel.styles import deinterleave_parts

    return {
        name: deinterleave_parts(t, tuple(fused[name]["parts"]), fused[name]["tp"]) if name in fused else t
        for name, t in tensors.items()
    }


def read_tensors(ckpt: Path, names: list[str], metas: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """Read just ``names`` (full, unsharded) from the DCP files into CPU tensors."""
    state = {name: torch.empty(tuple(metas[name].size), dtype=metas[name].properties.dtype) for name in names}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is the intent
        dcp.load(
            {"model": state},
            storage_reader=SafeFileSystemReader(str(ckpt / DCP_DIR)),
            planner=SafeLoadPlanner(allow_partial_load=False),
            no_dist=True,
        )
    return state


def copy_hf_files(ckpt: Path, out: Path, report: ExportReport, tokenizer_dir: str | Path | None) -> None:
    """config.json, generation_config.json and the tokenizer, from the checkpoint (or ``tokenizer_dir``)."""
    hf = ckpt / HF_DIR
    if not (hf / "config.json").is_file():
        raise mf.CheckpointError(f"{hf / 'config.json'} is missing: the checkpoint was saved from a model without an HF config")
    for name in ("config.json", "generation_config.json"):
        if (hf / name).is_file():
            shutil.copy2(hf / name, out / name)
            report.files.append(name)
    if tokenizer_dir is not None:
        # A user's folder may be a whole model folder: save only the tokenizer, never its config or weights.
        from transformers import AutoTokenizer

        before = {p.name for p in out.iterdir()}
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
        report.files.extend(sorted({p.name for p in out.iterdir()} - before))
        return
    source = hf / "tokenizer"
    if source.is_dir():
        for item in sorted(source.iterdir()):
            if item.is_file():
                shutil.copy2(item, out / item.name)
                report.files.append(item.name)


def drop_tied(names: dict, config_dir: Path) -> dict:
    """``names`` without the tied aliases whose source is there (as ``save_pretrained`` writes a tied pair once),
    by the model's own ``_tied_weights_keys`` (model of ``config_dir/config.json`` on ``meta``)."""
    from hf_dist.checkpoint.export.verify import meta_model
    from hf_dist.state_dict import tied_sources

    tied = tied_sources(meta_model(config_dir))
    return {k: v for k, v in names.items() if not (k in tied and tied[k] in names)}


def verify_checksums(ckpt: Path, manifest: mf.Manifest) -> int:
    """Every file against its size and SHA-256 in the manifest (``CheckpointError`` naming the first bad one)."""
    mf.verify_files(ckpt, manifest, "sha256")
    return sum(1 for entry in manifest.files if entry.sha256 is not None)


def export_causal_lm(
    ckpt: str | Path,
    out: str | Path,
    *,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | Path | None = None,
    verify: bool | str = "tensors",
    overwrite: bool = False,
) -> ExportReport:
    """Write a ``from_pretrained``-ready folder for the model in checkpoint ``ckpt``.

    ``verify``: ``'tensors'`` (default; bounded memory), ``'logits'`` (~2x the model in host RAM) or ``'none'``.
    """
    from hf_dist.checkpoint.export.verify import verify_mode

    mode = verify_mode(verify)
    ckpt, out = mf.resolve_checkpoint(ckpt), Path(out)
    manifest = mf.read_manifest(ckpt)
    if manifest.model_kind == "peft":
        raise ValueError(f"{ckpt} holds a PEFT model; export it with adapter='adapter' or adapter='merged'")
    checked = verify_checksums(ckpt, manifest)  # before the output folder is touched
    prepare_out(out, overwrite)
    report = ExportReport(out_dir=out, checksums_verified=checked)
    copy_hf_files(ckpt, out, report, tokenizer_dir)
    metas = drop_tied(tensor_metadata(ckpt), out)
    for name, meta in metas.items():
        check_complete_tensor(name, meta)
    entries = {n: (tuple(m.size), m.properties.dtype) for n, m in metas.items()}
    write_model_weights(out, entries, lambda names: hf_order(read_tensors(ckpt, names, metas), manifest.fused_rows),
                        max_shard_size, report)
    check_export(ckpt, out, mode, report)
    return report


def check_export(ckpt: Path, out: Path, mode: str, report: ExportReport) -> None:
    """Verify folder ``out`` against hf_dist checkpoint ``ckpt`` into ``report`` (``mode``: ``export_causal_lm``'s)."""
    from hf_dist.checkpoint.export.verify import verify_tensors

    fused = mf.read_manifest(ckpt).fused_rows
    metas = drop_tied(tensor_metadata(ckpt), out)
    report.verification = mode
    if mode == "tensors":
        def expected(name: str) -> torch.Tensor:
            return hf_order(read_tensors(ckpt, [name], metas), fused)[name]

        report.tensors_verified = verify_tensors(out, expected, set(metas))
    elif mode == "logits":
        report.max_logit_diff = verify_export(ckpt, out, metas, fused)


def reference_model(ckpt: Path, metas: dict[str, TensorStorageMetadata], fused: dict[str, dict] | None = None):
    """The checkpoint's model built from its config, with every tensor read directly from the DCP files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(ckpt / HF_DIR))
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(metas.values())).properties.dtype)
    state = hf_order(read_tensors(ckpt, list(metas), metas), fused or {})
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    real_missing = [k for k in missing if k not in allowed]
    if unexpected or real_missing:
        raise mf.CheckpointError(f"checkpoint does not match its config: missing {real_missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def verify_export(ckpt: Path, out: Path, metas: dict[str, TensorStorageMetadata], fused: dict[str, dict]) -> float:
    from transformers import AutoModelForCausalLM

    reference = reference_model(ckpt, metas, fused)
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=reference.dtype).eval()
    return compare_logits(reference, exported, reference.config.vocab_size, 0.0, f"export {out}")

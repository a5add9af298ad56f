"""Export a checkpoint the Trainer wrote itself (DDP, one process) to a Hub-ready folder, verified.

A Trainer-native ``checkpoint-N`` already holds ``save_pretrained`` output (``model.safetensors`` or shards +
index, ``config.json``) next to the optimizer, scheduler and RNG files. Exporting it means: check it as
``from_pretrained`` would load it (its structure on ``meta`` by transformers' renaming rules: no tensor missing,
unexpected or mis-shaped) and that every tensor is finite, one tensor at a time; then copy the tensors with the
requested shard size, one output shard in memory, plus config and tokenizer; then verify the written folder
(``verify``: by default its structure and every tensor against the checkpoint's, one at a time;
``verify="logits"`` compares logits of the two loaded models). Where transformers assembles tensors from several
stored ones (old MoE layouts), the model is loaded once with ``from_pretrained`` and re-saved instead. Such a
checkpoint records no checksums (only hf_dist checkpoints do), so a same-size corruption that stays finite cannot
be detected here; the report says so.

Not here: hf_dist checkpoints (``dcp``), LoRA (``lora``), DeepSpeed ZeRO folders (``zero``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.export.folder import ExportReport, compare_logits, prepare_out, write_model_weights
from hf_dist.file_modes import give_user_mode


def load_checked(ckpt: Path):
    """The checkpoint's model, loaded by ``from_pretrained``; ``CheckpointError`` naming any bad weight."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype="auto", output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # e.g. a truncated safetensors file
        raise mf.CheckpointError(f"{ckpt}: the model does not load ({err}); the checkpoint is damaged") from err
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise mf.CheckpointError(f"{ckpt}: weights do not match config.json: {problems}")
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise mf.CheckpointError(f"{ckpt}: tensors with NaN or Inf values: {bad[:5]}; the checkpoint is damaged")
    return model.eval()


def _streamable(ckpt: Path):
    """``(files, model name -> file key)`` of a folder that can be copied tensor by tensor, after checking its
    structure (what ``from_pretrained`` would report missing, unexpected or mis-shaped) and that every tensor is
    finite; ``None`` where transformers assembles tensors from several stored ones (then ``load_checked``)."""
    from safetensors import SafetensorError

    from hf_dist.checkpoint.export.verify import AssembledError, stored_tensors

    try:
        files, to_file = stored_tensors(ckpt)
        bad = [name for name, key in to_file.items() if not _finite(files.read(key, ()))]
    except AssembledError:
        return None
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # e.g. a truncated safetensors file
        raise mf.CheckpointError(f"{ckpt}: the model does not load ({err}); the checkpoint is damaged") from err
    if bad:
        raise mf.CheckpointError(f"{ckpt}: tensors with NaN or Inf values: {bad[:5]}; the checkpoint is damaged")
    return files, to_file


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


def _write_streamed(ckpt: Path, out: Path, files, to_file: dict[str, str], max_shard_size, report) -> None:
    """The model's tensors, one output shard in memory at a time, under the names ``from_pretrained`` gives them."""
    import shutil

    def dtype(key: str) -> torch.dtype:  # an empty slice reads no data
        return files.read(key, (slice(0, 0),)).dtype if files.shape_of[key] else files.read(key, ()).dtype

    entries = {name: (files.shape_of[key], dtype(key)) for name, key in to_file.items()}
    write_model_weights(out, entries, lambda names: {n: files.read(to_file[n], ()) for n in names}, max_shard_size,
                        report)
    for name in ("config.json", "generation_config.json"):
        if (ckpt / name).is_file():
            shutil.copy2(ckpt / name, out / name)


def export_native(
    ckpt: str | Path,
    out: str | Path,
    *,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | Path | None = None,
    verify: bool | str = "tensors",
    overwrite: bool = False,
) -> ExportReport:
    """Write a ``from_pretrained``-ready folder for the model in Trainer checkpoint ``ckpt``.

    Streamed tensor by tensor (one output shard in memory) unless transformers assembles some tensors from several
    stored ones; then the model is loaded once with ``from_pretrained`` and saved with ``save_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.checkpoint.export.verify import source_tensors, verify_mode, verify_same_files, verify_tensors

    mode = verify_mode(verify)
    ckpt, out = Path(ckpt), Path(out)
    if (ckpt / "adapter_config.json").is_file():
        raise ValueError(f"{ckpt} holds a LoRA adapter saved by the Trainer; it is already a PEFT folder "
                         f"(load it with AutoPeftModelForCausalLM), export only full-model checkpoints")
    streamed = _streamable(ckpt)  # before the output folder is touched
    model = load_checked(ckpt) if streamed is None else None
    prepare_out(out, overwrite)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    report = ExportReport(out_dir=out)
    if streamed is not None:
        _write_streamed(ckpt, out, *streamed, max_shard_size, report)
    else:
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
        give_user_mode(out)  # safetensors leaves 0600
        report.total_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tokenizer_source = Path(tokenizer_dir) if tokenizer_dir is not None else ckpt
    if (tokenizer_source / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(str(out))
    report.files = sorted(p.name for p in out.iterdir() if before.get(p.name) != p.stat().st_mtime_ns)
    shards = [out / name for name in report.files if name.endswith(".safetensors")]
    report.largest_shard_bytes = report.largest_shard_bytes or max(p.stat().st_size for p in shards)
    report.verification = mode
    if mode == "tensors":
        del model  # the check below holds one tensor of each folder at a time
        report.tensors_verified = (verify_tensors(out, *source_tensors(ckpt)) if streamed is not None
                                   else verify_same_files(out, ckpt))
    elif mode == "logits":
        model = model if model is not None else load_checked(ckpt)
        exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=model.dtype).eval()
        report.max_logit_diff = compare_logits(model, exported, model.config.vocab_size, 0.0, f"export {out}")
    return report

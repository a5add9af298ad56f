"""Export a checkpoint the Trainer wrote itself (DDP, one process) to a Hub-ready folder, verified.

A Trainer-native ``checkpoint-N`` already holds ``save_pretrained`` output (``model.safetensors`` or shards +
index, ``config.json``) next to the optimizer, scheduler and RNG files. Exporting it means: load the model as a
user would, refuse it when any weight is missing, unexpected, of the wrong shape or not finite, write it with
the requested shard size plus the tokenizer, and check the written folder: by default its structure on ``meta``
and every tensor against the checkpoint's files, one tensor at a time (``export_verify``); with
``verify="logits"`` by comparing logits of the two loaded models. The export itself holds the model once. Such a checkpoint records no checksums (only hf_dist checkpoints do), so a same-size corruption that
stays finite cannot be detected here; the report says so.

Not here: hf_dist checkpoints (``export``), LoRA (``lora_export``), DeepSpeed ZeRO folders (``zero``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.export import INDEX_NAME, ExportReport, compare_logits, prepare_out

_WEIGHTS = ("model.safetensors", INDEX_NAME)


def is_native_model_dir(path: Path) -> bool:
    """A folder with ``save_pretrained`` weights and config and no hf_dist manifest (a Trainer checkpoint)."""
    return (
        path.is_dir()
        and not (path / mf.MANIFEST_NAME).exists()
        and (path / "config.json").is_file()
        and any((path / name).is_file() for name in _WEIGHTS)
    )


def load_checked(ckpt: Path):
    """The checkpoint's model, loaded by ``from_pretrained``; ``CheckpointError`` naming any bad weight."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if (ckpt / "adapter_config.json").is_file():
        raise ValueError(f"{ckpt} holds a LoRA adapter saved by the Trainer; it is already a PEFT folder "
                         f"(load it with AutoPeftModelForCausalLM), export only full-model checkpoints")
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


def export_native(
    ckpt: str | Path,
    out: str | Path,
    *,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | Path | None = None,
    verify: bool | str = "tensors",
    overwrite: bool = False,
) -> ExportReport:
    """Write a ``from_pretrained``-ready folder for the model in Trainer checkpoint ``ckpt``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.checkpoint.export_verify import source_tensors, verify_mode, verify_tensors

    mode = verify_mode(verify)
    ckpt, out = Path(ckpt), Path(out)
    model = load_checked(ckpt)  # before the output folder is touched
    prepare_out(out, overwrite)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    tokenizer_source = Path(tokenizer_dir) if tokenizer_dir is not None else ckpt
    if (tokenizer_source / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(str(out))
    report = ExportReport(out_dir=out)
    report.files = sorted(p.name for p in out.iterdir() if before.get(p.name) != p.stat().st_mtime_ns)
    shards = [out / name for name in report.files if name.endswith(".safetensors")]
    report.total_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    report.largest_shard_bytes = max(p.stat().st_size for p in shards)
    report.verification = mode
    if mode == "tensors":
        del model  # the check below holds one tensor of each folder at a time
        report.tensors_verified = verify_tensors(out, *source_tensors(ckpt))
    elif mode == "logits":
        exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=model.dtype).eval()
        report.max_logit_diff = compare_logits(model, exported, model.config.vocab_size, 0.0, f"export {out}")
    return report

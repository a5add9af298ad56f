"""``export_checkpoint``: the one entry that exports any checkpoint kind hf_dist reads to a Hub-format directory.

It picks the exporter: Trainer-native checkpoints (``native_export``), DeepSpeed ZeRO folders (``zero``), LoRA
checkpoints (``lora_export``), everything else (``export``). Kept apart from them so that they can share ``export``'s helpers without an import circle.
"""

from __future__ import annotations

from pathlib import Path

from hf_dist.checkpoint.export import ExportReport, export_causal_lm
from hf_dist.checkpoint.lora_export import export_peft
from hf_dist.checkpoint.native_export import export_native, is_native_model_dir
from hf_dist.checkpoint.zero import export_zero, is_zero_checkpoint


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    *,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | Path | None = None,
    adapter: str | None = None,
    config_dir: str | Path | None = None,
    verify: bool | str = "tensors",
    overwrite: bool = False,
    trust_pickles: bool = False,
) -> ExportReport:
    """Export an hf_dist checkpoint, a LoRA one (``adapter='adapter'|'merged'``), a DeepSpeed ZeRO folder, or a
    checkpoint the Trainer wrote itself (DDP, one process: ``model.safetensors`` + ``config.json``).

    ``verify``: ``'tensors'`` (default: the folder's structure on ``meta`` and every tensor against the checkpoint,
    about one tensor in memory), ``'logits'`` (two whole models compared on a probe batch: ~2x the model in host
    RAM) or ``'none'``; ``True``/``False`` mean ``'tensors'``/``'none'``."""
    common = dict(max_shard_size=max_shard_size, tokenizer_dir=tokenizer_dir, verify=verify, overwrite=overwrite)
    if is_native_model_dir(Path(ckpt)):
        if adapter is not None:
            raise ValueError(f"{ckpt} is a Trainer-native checkpoint of a plain model; export it without --adapter")
        return export_native(ckpt, out, **common)
    if is_zero_checkpoint(Path(ckpt)):
        return export_zero(ckpt, out, config_dir=config_dir, trust_pickles=trust_pickles, **common)
    if adapter is not None:
        return export_peft(ckpt, out, mode=adapter, **common)
    return export_causal_lm(ckpt, out, **common)

"""``export_checkpoint``: any checkpoint kind hf_dist reads, exported to a Hub-format folder, verified.

It asks ``checkpoint_kind`` what wrote the folder and picks the exporter: hf_dist checkpoints (``dcp``, or ``lora``
with ``adapter=``), Trainer-native checkpoints and plain ``save_pretrained`` folders (``native``), DeepSpeed ZeRO
folders (``zero``). The exporters write their weights through hf_dist's Hub writer
(``folder.write_model_weights`` on ``hf_dist.hub_writer``), except where ``native`` re-saves a checkpoint whose tensors
transformers assembles from several stored ones (transformers' ``save_pretrained``).

Modules: ``folder`` (the output folder, ``ExportReport``), one exporter per kind (``dcp``, ``lora``, ``native``,
``zero``), and the bounded verification of what they wrote (``verify``, ``lora_verify``).
"""

from __future__ import annotations

from pathlib import Path

from hf_dist.checkpoint.export.dcp import export_causal_lm
from hf_dist.checkpoint.export.folder import ExportReport
from hf_dist.checkpoint.export.lora import export_peft
from hf_dist.checkpoint.export.native import export_native
from hf_dist.checkpoint.export.zero import export_zero
from hf_dist.checkpoint.kind import checkpoint_kind

__all__ = ["ExportReport", "export_causal_lm", "export_checkpoint", "export_native", "export_peft", "export_zero"]


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
    kind = checkpoint_kind(ckpt)
    if kind in ("trainer_native", "model_dir"):
        if adapter is not None:
            raise ValueError(f"{ckpt} is a Trainer-native checkpoint of a plain model; export it without --adapter")
        return export_native(ckpt, out, **common)
    if kind in ("zero", "trainer_zero"):
        return export_zero(ckpt, out, config_dir=config_dir, trust_pickles=trust_pickles, **common)
    if adapter is not None:
        return export_peft(ckpt, out, mode=adapter, **common)
    return export_causal_lm(ckpt, out, **common)  # an hf_dist checkpoint, or a run folder (its ``latest``)

"""DeepSpeed ZeRO checkpoints, read through DeepSpeed and converted to an hf_dist checkpoint (to resume under
FSDP2/TP); the Hub export (``hf_dist.checkpoint.export.zero``) reads them here too.

Both go through DeepSpeed's own ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``), in its lazy
mode: tensors are gathered from the rank partitions one at a time, so the export streams shard by shard.
DeepSpeed's files are pickles (its format), which ``zero_to_fp32`` reads with ``weights_only=False``: unlike
every other loader in hf_dist this can run code from the checkpoint, so the caller must say it trusts the
folder (``trust_pickles=True``, CLI ``--trust-deepspeed-pickles``).

The optimizer state is not converted (ZeRO keeps it as flat partitions); a converted checkpoint holds the
model only and resumes with a fresh optimizer, which ``load_checkpoint(optimizer=None)`` makes explicit.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from hf_dist.checkpoint import manifest as mf

_TRUST_HINT = (
    "DeepSpeed checkpoints are Python pickles that can run code when loaded; if you trust {path}, pass "
    "trust_pickles=True (CLI: --trust-deepspeed-pickles)"
)


def tag_and_step(path: Path, tag: str | None) -> tuple[str, int]:
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"{latest} is missing; pass the tag (e.g. global_step100) explicitly")
        tag = latest.read_text(encoding="utf-8").strip()
    match = re.search(r"(\d+)$", tag)
    return tag, int(match.group(1)) if match else 0


def config_source_dir(path: Path, config_dir: str | Path | None) -> Path:
    source = Path(config_dir) if config_dir is not None else path
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source / 'config.json'} is missing; pass the folder with the model's config.json")
    return source


def lazy_state(path: Path, tag: str | None, trust_pickles: bool) -> dict:
    """The consolidated fp32 state dict as lazy tensors (materialised by ``.contiguous()``)."""
    if not trust_pickles:
        raise ValueError(_TRUST_HINT.format(path=path))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag, lazy_mode=True)


def full_model(path: Path, config_dir: Path, state: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {name: lazy.contiguous() for name, lazy in state.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or [k for k in missing if k not in allowed]:
        raise mf.CheckpointError(f"ZeRO checkpoint {path} does not match {config_dir / 'config.json'}: "
                                 f"missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def convert_zero_checkpoint(
    zero_dir: str | Path,
    out_dir: str | Path,
    *,
    config_dir: str | Path | None = None,
    tag: str | None = None,
    samples_consumed: int = 0,
    trust_pickles: bool = False,
) -> Path:
    """Write the model of a ZeRO checkpoint as a (one-rank, model-only) hf_dist checkpoint at ``out_dir``.

    Load it into any layout with ``load_checkpoint(out_dir, model=..., optimizer=None)``. ``samples_consumed``:
    the data position to record (ZeRO checkpoints do not hold it in a form hf_dist can read).
    """
    from hf_dist.checkpoint.api import save_checkpoint
    from hf_dist.parallel_dims import ParallelDims

    path = Path(zero_dir)
    tag, step = tag_and_step(path, tag)
    model = full_model(path, config_source_dir(path, config_dir), lazy_state(path, tag, trust_pickles))
    save_checkpoint(
        out_dir, model=model, optimizer=None, step=step, samples_consumed=samples_consumed,
        layout=ParallelDims(world_size=1), batch_contract=None, extra={"converted_from": str(path), "zero_tag": tag},
    )
    return Path(out_dir)

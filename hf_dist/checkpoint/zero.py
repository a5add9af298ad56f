"""DeepSpeed ZeRO checkpoints: convert to an hf_dist checkpoint (to resume under FSDP2/TP), or export to the Hub.

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
import shutil
from pathlib import Path

import torch

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.export.folder import ExportReport, compare_logits, prepare_out, write_model_weights

_TRUST_HINT = (
    "DeepSpeed checkpoints are Python pickles that can run code when loaded; if you trust {path}, pass "
    "trust_pickles=True (CLI: --trust-deepspeed-pickles)"
)


def _tag_and_step(path: Path, tag: str | None) -> tuple[str, int]:
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"{latest} is missing; pass the tag (e.g. global_step100) explicitly")
        tag = latest.read_text(encoding="utf-8").strip()
    match = re.search(r"(\d+)$", tag)
    return tag, int(match.group(1)) if match else 0


def _config_dir(path: Path, config_dir: str | Path | None) -> Path:
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


def _full_model(path: Path, config_dir: Path, state: dict):
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
    tag, step = _tag_and_step(path, tag)
    model = _full_model(path, _config_dir(path, config_dir), lazy_state(path, tag, trust_pickles))
    save_checkpoint(
        out_dir, model=model, optimizer=None, step=step, samples_consumed=samples_consumed,
        layout=ParallelDims(world_size=1), batch_contract=None, extra={"converted_from": str(path), "zero_tag": tag},
    )
    return Path(out_dir)


def export_zero(
    zero_dir: str | Path,
    out: str | Path,
    *,
    config_dir: str | Path | None = None,
    tag: str | None = None,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | Path | None = None,
    verify: bool | str = "tensors",
    overwrite: bool = False,
    trust_pickles: bool = False,
) -> ExportReport:
    """Hub-ready folder from a ZeRO checkpoint, one output shard materialised at a time (``verify``: as
    ``export_checkpoint``'s; the default checks every tensor against ``zero_to_fp32``'s, one at a time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist.checkpoint.export_verify import verify_mode, verify_tensors

    mode = verify_mode(verify)
    path, out = Path(zero_dir), Path(out)
    tag, _ = _tag_and_step(path, tag)
    config_source = _config_dir(path, config_dir)
    state = lazy_state(path, tag, trust_pickles)
    config = AutoConfig.from_pretrained(str(config_source))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    prepare_out(out, overwrite)
    report = ExportReport(out_dir=out)
    config.save_pretrained(str(out))
    report.files.append("config.json")
    extras = [path / "generation_config.json"] if (path / "generation_config.json").is_file() else []
    for source in extras + _tokenizer_files(path, tokenizer_dir):
        shutil.copy2(source, out / source.name)
        report.files.append(source.name)
    entries = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    write_model_weights(out, entries, lambda names: {n: state[n].contiguous() for n in names}, max_shard_size, report)
    report.verification = mode
    if mode == "tensors":
        report.tensors_verified = verify_tensors(out, lambda name: state[name].contiguous(), set(state))
    elif mode == "logits":
        reference = _full_model(path, config_source, state)
        exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        report.max_logit_diff = compare_logits(reference, exported, config.vocab_size, 0.0, f"export {out}")
    return report


def _tokenizer_files(path: Path, tokenizer_dir: str | Path | None) -> list[Path]:
    source = Path(tokenizer_dir) if tokenizer_dir is not None else path
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
             "merges.txt", "chat_template.jinja")
    return [source / n for n in names if (source / n).is_file()]

"""Export a DeepSpeed ZeRO checkpoint folder to a Hub-ready folder, one output shard materialised at a time.

The tensors come from DeepSpeed's own ``zero_to_fp32`` in its lazy mode (``hf_dist.checkpoint.zero.lazy_state``,
which asks the caller to trust the folder's pickles) and are written through hf_dist's Hub writer; the config comes
from the folder or ``config_dir``. Verification (``verify``) checks every tensor against ``zero_to_fp32``'s.

Not here: converting a ZeRO checkpoint into an hf_dist one to resume (``hf_dist.checkpoint.zero``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hf_dist.checkpoint.export.folder import ExportReport, compare_logits, prepare_out, write_model_weights
from hf_dist.checkpoint.zero import config_source_dir, full_model, lazy_state, tag_and_step


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

    from hf_dist.checkpoint.export.verify import verify_mode, verify_tensors

    mode = verify_mode(verify)
    path, out = Path(zero_dir), Path(out)
    tag, _ = tag_and_step(path, tag)
    config_source = config_source_dir(path, config_dir)
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
        reference = full_model(path, config_source, state)
        exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        report.max_logit_diff = compare_logits(reference, exported, config.vocab_size, 0.0, f"export {out}")
    return report


def _tokenizer_files(path: Path, tokenizer_dir: str | Path | None) -> list[Path]:
    source = Path(tokenizer_dir) if tokenizer_dir is not None else path
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
             "merges.txt", "chat_template.jinja")
    return [source / n for n in names if (source / n).is_file()]

"""Export a LoRA (PEFT) training checkpoint: the adapter alone, or merged into the base weights.

Adapter-only writes ``adapter_model.safetensors`` + ``adapter_config.json`` as PEFT's ``save_pretrained`` does
(adapter name dropped from the keys). Every adapter tensor must be whole: not empty (the ZeRO-3/FSDP1 failure
where an adapter saved as 0-element placeholders) and covered by its saved chunks (not one rank's shard), with
the rank the config declares. Merged writes a plain causal-LM folder, shard by shard: each base weight is read
with its ``lora_A``/``lora_B`` and merged as ``W + scale * B @ A``; a parameter adapter (PEFT's ``target_parameters``
on 3-D expert weights ``[E, out, in]``) as ``W_e + scale * B_e @ A_e`` for each expert ``e``.

Verification (``verify``, ``lora_verify``), by default with about one tensor in memory: the merged folder's
structure on ``meta`` and each merged weight against PEFT's own merge of that one module (a ``peft`` LoRA layer
built around the checkpoint's base weight and adapter tensors); the adapter folder's keys and shapes against what
PEFT saves for the config (PEFT model on ``meta``), its config loaded by ``LoraConfig``, and each adapter tensor
against the checkpoint's. ``verify="logits"`` loads whole models and compares logits on a probe batch (~2x the model in RAM).
Not here: plain models (``dcp``). Only LoRA A/B adapters with one adapter name are handled.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.api import HF_DIR
from hf_dist.checkpoint.export.dcp import (
    check_complete_tensor,
    copy_hf_files,
    drop_tied,
    read_tensors,
    tensor_metadata,
    verify_checksums,
)
from hf_dist.checkpoint.export.folder import ExportReport, compare_logits, prepare_out, write_model_weights
from hf_dist.checkpoint.export.lora_verify import lora_targets, verify_adapter, verify_merged
from hf_dist.hub_writer import ADAPTER_FILES
from hf_dist.models.peft_utils import without_base_layers

BASE_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


def _adapter_dir(ckpt: Path) -> Path:
    adapters = sorted((ckpt / HF_DIR / "adapter").glob("*/adapter_config.json"))
    if len(adapters) != 1:
        raise mf.CheckpointError(
            f"{ckpt / HF_DIR / 'adapter'} holds {len(adapters)} adapter configs; export handles exactly one adapter"
        )
    return adapters[0].parent


def _split_keys(metas: dict, adapter: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``{module: {"A": key, "B": key}}`` for LoRA pairs, and the remaining (base) keys."""
    pairs: dict[str, dict[str, str]] = {}
    base = []
    for key in metas:
        match = _LORA.match(key)
        if match and match["adapter"] == adapter:
            pairs.setdefault(match["module"], {})[match["which"]] = key
        elif f".{adapter}." in key or key.endswith(f".{adapter}"):
            raise mf.CheckpointError(f"adapter tensor {key} is not a LoRA A/B weight; export handles LoRA only")
        else:
            base.append(key)
    return pairs, base


def _check_adapter(metas: dict, pairs: dict, config: dict) -> None:
    if not pairs:
        raise mf.CheckpointError("the checkpoint holds no LoRA tensors: refusing to write an empty adapter")
    r = config["r"]
    for module, keys in pairs.items():
        if set(keys) != {"A", "B"}:
            raise mf.CheckpointError(f"LoRA module {module} has only lora_{''.join(keys)}: the adapter is incomplete")
        for which, key in keys.items():
            check_complete_tensor(key, metas[key])
            size = tuple(metas[key].size)
            rank_dim = size[0] if which == "A" else size[1]
            # a parameter adapter (target_parameters) stacks r rows/columns per expert
            per_expert = config.get("target_parameters") and rank_dim % r == 0
            if not config.get("rank_pattern") and rank_dim != r and not per_expert:
                raise mf.CheckpointError(f"{key} has shape {size} but the adapter config says r={r}")


def _base_name(key: str) -> str:
    return without_base_layers(key[len(BASE_PREFIX) :] if key.startswith(BASE_PREFIX) else key)


def _merged_names(ckpt: Path, base: list[str], pairs: dict) -> dict[str, str]:
    """``{model name: checkpoint key}`` of the merged folder's weights: every base weight, a tied alias (a tied
    ``lm_head.weight``) once, as ``save_pretrained`` and the plain export (``drop_tied``) write it, unless an adapter
    targets the alias."""
    names = {_base_name(key): key for key in base}
    kept = drop_tied(names, ckpt / HF_DIR)
    targeted = {_base_name(module) for module in pairs}
    return {n: k for n, k in names.items() if n in kept or n.rpartition(".")[0] in targeted}


def _scale(config: dict) -> float:
    if config.get("alpha_pattern") or config.get("rank_pattern"):
        raise ValueError("merging an adapter with rank_pattern/alpha_pattern is not supported; export adapter-only")
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def _delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * B @ A`` in the adapter's dtype; half-precision adapters multiply in fp32 (as PEFT does on CPU)."""
    if a.dtype in (torch.float16, torch.bfloat16):
        return (b.float() @ a.float() * scale).to(a.dtype)
    return b @ a * scale


def _param_delta(a: torch.Tensor, b: torch.Tensor, scale: float, experts: int, swapped: bool) -> torch.Tensor:
    """A parameter adapter's ``[E, out, in]`` (``swapped``) or ``[E, in, out]`` update: expert ``e``'s ``B_e @ A_e``,
    with ``A [E * r, in]`` holding the experts' rows one after another and ``B [out, r * E]`` their columns
    interleaved (column ``k * E + e``), as PEFT's ``ParamWrapper`` lays them out."""
    a3 = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], -1, experts)  # [out, r, E]
    return torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", b3, a3) * scale


def _merged_producer(ckpt: Path, metas: dict, pairs: dict, base_keys: dict[str, str], config: dict):
    scale, transpose = _scale(config), bool(config.get("fan_in_fan_out"))
    targets = lora_targets(ckpt, config, pairs, base_keys)

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        keys = [base_keys[n] for n in names]
        lora_keys = [pairs[targets[k][0]][w] for k in keys if k in targets for w in "AB"]
        tensors = read_tensors(ckpt, keys + lora_keys, metas)
        out = {}
        for name, key in zip(names, keys):
            weight = tensors[key]
            if key in targets:
                module, swapped = targets[key]
                a, b = tensors[pairs[module]["A"]], tensors[pairs[module]["B"]]
                if swapped is None:
                    delta = _delta(a, b, scale)
                    # one rounding to the weight's dtype, after the sum (as PEFT's in-place merge rounds)
                    weight = (weight + (delta.T if transpose else delta)).to(weight.dtype)
                else:  # PEFT's ParamWrapper rounds its update to the weight's dtype before adding it
                    weight = weight + _param_delta(a, b, scale, weight.shape[0], swapped).to(weight.dtype)
            out[name] = weight
        return out

    return produce


def _write_adapter(ckpt: Path, out: Path, metas: dict, pairs: dict, adapter_dir: Path, report: ExportReport) -> None:
    """``adapter_model.safetensors`` (one file, adapter name dropped from the keys) and ``adapter_config.json``."""
    keys = {key.replace(f".{adapter_dir.name}.", "."): key for keys in pairs.values() for key in keys.values()}

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = read_tensors(ckpt, [keys[name] for name in names], metas)
        return {name: tensors[keys[name]] for name in names}

    entries = {name: (tuple(metas[key].size), metas[key].properties.dtype) for name, key in keys.items()}
    write_model_weights(out, entries, produce, None, report, filename_pattern=ADAPTER_FILES)
    shutil.copy2(adapter_dir / "adapter_config.json", out / "adapter_config.json")
    report.files.append("adapter_config.json")


def export_peft(
    ckpt: str | Path,
    out: str | Path,
    *,
    mode: str,
    max_shard_size: int | str = "2GB",
    tokenizer_dir: str | Path | None = None,
    verify: bool | str = "tensors",
    overwrite: bool = False,
) -> ExportReport:
    """Write the LoRA adapter of ``ckpt`` (``mode='adapter'``) or the merged model (``mode='merged'``)."""
    from hf_dist.checkpoint.export.verify import verify_mode

    check = verify_mode(verify)
    if mode not in ("adapter", "merged"):
        raise ValueError(f"adapter={mode!r} is not an export mode; use 'adapter' or 'merged'")
    ckpt, out = mf.resolve_checkpoint(ckpt), Path(out)
    manifest = mf.read_manifest(ckpt)
    if manifest.model_kind != "peft":
        raise ValueError(f"{ckpt} holds a plain model (no adapter); export it without --adapter")
    adapter_dir = _adapter_dir(ckpt)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    metas = tensor_metadata(ckpt)
    pairs, base = _split_keys(metas, adapter_dir.name)
    _check_adapter(metas, pairs, config)
    checked = verify_checksums(ckpt, manifest)  # before the output folder is touched
    prepare_out(out, overwrite)
    report = ExportReport(out_dir=out, checksums_verified=checked)
    if mode == "adapter":
        _write_adapter(ckpt, out, metas, pairs, adapter_dir, report)
    else:
        base_keys = _merged_names(ckpt, base, pairs)
        entries = {n: (tuple(metas[k].size), metas[k].properties.dtype) for n, k in base_keys.items()}
        write_model_weights(out, entries, _merged_producer(ckpt, metas, pairs, base_keys, config), max_shard_size,
                            report)
    copy_hf_files(ckpt, out, report, tokenizer_dir)
    if mode == "adapter":
        (out / "config.json").unlink()  # an adapter folder is not a model folder: from_pretrained must not see one
        report.files.remove("config.json")
    report.verification = check
    if check == "tensors" and mode == "adapter":
        report.tensors_verified = verify_adapter(ckpt, out, metas, pairs, adapter_dir.name)
    elif check == "tensors":
        report.tensors_verified = verify_merged(ckpt, out, metas, pairs, base_keys, adapter_dir.name, adapter_dir)
    elif check == "logits":
        report.max_logit_diff = _verify(ckpt, out, adapter_dir, metas, base, mode)
    return report


def _verify(ckpt: Path, out: Path, adapter_dir: Path, metas: dict, base: list[str], mode: str) -> float:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(ckpt / HF_DIR))
    reference = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig.from_pretrained(str(adapter_dir)))
    reference.load_state_dict(read_tensors(ckpt, list(metas), metas), strict=True)
    reference.eval()
    if mode == "merged":
        exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        return compare_logits(reference, exported, config.vocab_size, 1e-4, f"merged export {out}")
    fresh_base = AutoModelForCausalLM.from_config(config)
    fresh_base.load_state_dict({_base_name(k): v for k, v in read_tensors(ckpt, base, metas).items()}, strict=True)
    exported = PeftModel.from_pretrained(fresh_base, str(out)).eval()
    return compare_logits(reference, exported, config.vocab_size, 0.0, f"adapter export {out}")

"""Bounded verification of a LoRA export: PEFT's own code on one module at a time, never a whole model.

``verify_merged``: the merged folder's structure (``verify.check_structure``), then each merged weight
against PEFT's merge of that one module: a ``peft`` LoRA ``Linear`` built around the checkpoint's base weight,
given the checkpoint's ``lora_A``/``lora_B`` and the adapter's ``LoraConfig``, merged by ``merge()``; equal in
every value (the arithmetic and its roundings are PEFT's). So a wrong scale, transpose, pairing or rounding order
in hf_dist's merge fails here. ``verify_adapter``: the adapter file's keys and shapes
against what PEFT saves for that config (``get_peft_model_state_dict`` of the PEFT model on ``meta``),
``adapter_config.json`` loaded by ``LoraConfig``, and each adapter tensor equal to the checkpoint's.

Not here: writing the export (``export.lora``), plain models (``verify``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.api import HF_DIR
from hf_dist.checkpoint.export.dcp import read_tensors
from hf_dist.checkpoint.export.verify import exact, meta_model, verify_tensors

ADAPTER_FILE = "adapter_model.safetensors"


def _peft_layer(weight: torch.Tensor, config, adapter: str) -> nn.Module:
    """PEFT's LoRA layer around ``weight`` (a ``Conv1D`` base when the config says ``fan_in_fan_out``)."""
    from peft.tuners.lora import Linear

    if config.fan_in_fan_out:
        from transformers.pytorch_utils import Conv1D

        base = Conv1D(weight.shape[1], weight.shape[0])
    else:
        base = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    base.weight = nn.Parameter(weight, requires_grad=False)
    return Linear(base, adapter, config=config, r=config.r, lora_alpha=config.lora_alpha,
                  is_target_conv_1d_layer=bool(config.fan_in_fan_out))


def lora_targets(ckpt: Path, config: dict, pairs: dict,
                 base_keys: dict[str, str]) -> dict[str, tuple[str, bool | None]]:
    """``{base key: (LoRA module, swapped)}`` for every base weight an adapter changes. ``swapped`` is None for a
    layer adapter (``lora.Linear``: the weight is ``<module>.base_layer.weight``); for a parameter adapter (PEFT's
    ``ParamWrapper``, ``target_parameters``: nested once per targeted parameter, so the weight is
    ``<module>.base_layer....<parameter>``) it is whether PEFT reads the 3-D weight as ``[E, out, in]``. Which wrapper
    holds which parameter is read from the PEFT model built on ``meta`` for this config, not guessed from names."""
    wrappers: dict[str, tuple[str, bool]] = {}  # wrapper module -> (its base weight's key, swapped)
    if config.get("target_parameters"):
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora.layer import ParamWrapper

        known = {k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__}
        peft_model = get_peft_model(meta_model(ckpt / HF_DIR), LoraConfig(**known))
        for name, module in peft_model.named_modules():
            if isinstance(module, ParamWrapper):
                inner, base = name, module
                while isinstance(base, ParamWrapper):
                    inner, base = f"{inner}.base_layer", base.base_layer
                wrappers[name] = (f"{inner}.{module.parameter_name}", module._did_swap_in_out_features)
    targets = {key: (module, swapped) for module, (key, swapped) in wrappers.items() if module in pairs}
    for key in base_keys.values():
        module = key.rsplit(".base_layer.", 1)[0] if key.endswith(".base_layer.weight") else None
        if module in pairs and module not in wrappers:
            targets[key] = (module, None)
    return targets


def peft_merged_param(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config, adapter: str,
                      swapped: bool) -> torch.Tensor:
    """The 3-D ``weight`` with the parameter adapter ``(a, b)`` merged in by PEFT's ``ParamWrapper.merge()``."""
    from peft.tuners.lora.layer import ParamWrapper

    with torch.no_grad():
        holder = nn.Module()
        holder.weight = nn.Parameter(weight.clone(), requires_grad=False)
        holder.is_transposed = not swapped  # PEFT reads [E, in, out] when the experts module says so
        layer = ParamWrapper(holder, adapter, parameter_name="weight", config=config, r=config.r,
                             lora_alpha=config.lora_alpha)
        layer.lora_A[adapter].weight = nn.Parameter(a, requires_grad=False)
        layer.lora_B[adapter].weight = nn.Parameter(b, requires_grad=False)
        layer.merge(adapter_names=[adapter])
        return holder.weight.detach()


def peft_merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config, adapter: str) -> torch.Tensor:
    """``weight`` with the adapter ``(a, b)`` merged in by PEFT's ``merge()``."""
    with torch.no_grad():
        layer = _peft_layer(weight.clone(), config, adapter)
        # the checkpoint's tensors as they are (PEFT keeps adapters in fp32 over a half-precision base by default)
        layer.lora_A[adapter].weight = nn.Parameter(a, requires_grad=False)
        layer.lora_B[adapter].weight = nn.Parameter(b, requires_grad=False)
        layer.merge(adapter_names=[adapter])
        return layer.get_base_layer().weight.detach()


def verify_merged(ckpt: Path, out: Path, metas: dict, pairs: dict, base_keys: dict[str, str], adapter: str,
                  adapter_dir: Path) -> int:
    """Structure of the merged folder, then every weight against PEFT's merge of its module; the count checked."""
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(adapter_dir))
    targets = lora_targets(ckpt, config.to_dict(), pairs, base_keys)

    def expected(name: str) -> torch.Tensor:
        key = base_keys[name]
        if key not in targets:
            return read_tensors(ckpt, [key], metas)[key]
        module, swapped = targets[key]
        a_key, b_key = pairs[module]["A"], pairs[module]["B"]
        t = read_tensors(ckpt, [key, a_key, b_key], metas)
        if swapped is not None:
            return peft_merged_param(t[key], t[a_key], t[b_key], config, adapter, swapped)
        return peft_merged_weight(t[key], t[a_key], t[b_key], config, adapter)

    return verify_tensors(out, expected, set(base_keys))


def verify_adapter(ckpt: Path, out: Path, metas: dict, pairs: dict, adapter: str) -> int:
    """The adapter folder against PEFT's own saved form of its config and the checkpoint's tensors; the count."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    config = LoraConfig.from_pretrained(str(out))
    wanted = get_peft_model_state_dict(get_peft_model(meta_model(ckpt / HF_DIR), config))
    source = {key.replace(f".{adapter}.", "."): key for keys in pairs.values() for key in keys.values()}
    with safe_open(str(out / ADAPTER_FILE), framework="pt") as handle:
        written = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    missing, extra = sorted(set(wanted) - set(written)), sorted(set(written) - set(wanted))
    if missing or extra:
        raise mf.CheckpointError(f"adapter export {out}: PEFT expects tensors {missing[:6]} that are missing, and "
                                 f"does not know {extra[:6]}")
    for key, shape in sorted(written.items()):
        if shape != tuple(wanted[key].shape):
            raise mf.CheckpointError(f"adapter export {out}: tensor {key} has shape {shape}, PEFT expects "
                                     f"{tuple(wanted[key].shape)} for this adapter config")
        with safe_open(str(out / ADAPTER_FILE), framework="pt") as handle:
            got = handle.get_tensor(key)
        problem = exact(key, got, read_tensors(ckpt, [source[key]], metas)[source[key]])
        if problem is not None:
            raise mf.CheckpointError(f"adapter export {out}: tensor {key} {problem}")
    return len(written)

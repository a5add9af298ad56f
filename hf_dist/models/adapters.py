"""LoRA adapters added the same way on every path, so that one command gives one model whatever the layout.

``add_adapters(model, peft_config, seed=args.seed)`` is PEFT's ``get_peft_model`` followed by PEFT's own
initialisation of every adapter, redrawn on the host from ``seed`` in module order. The plain path (one process,
DDP, DeepSpeed: transformers' ``from_pretrained`` or a model built in memory) and the streaming path (FSDP2 / TP /
PP: the base on ``meta``) both call it, so the adapters start equal everywhere: ``get_peft_model`` alone draws
them from whatever state the global generator is in, which differs between the paths (a meta base draws nothing
while it is built).

Not for: the base weights (``hf_dist.loading``), or adapters whose initialisation is computed from the base
weights (PiSSA, OLoRA, LoftQ, EVA, DoRA): those are left to PEFT (seeded, and deterministic given the base) on
the plain path and refused on a meta base, which holds no weights.
"""

from __future__ import annotations

import torch
from torch import nn

REDRAWN_INITS = (True, False, "gaussian")


def add_adapters(model: nn.Module, peft_config, *, seed: int) -> nn.Module:
    """``get_peft_model(model, peft_config)`` with every adapter initialised from ``seed`` (the run's
    ``TrainingArguments.seed``): the same adapters on one process, DDP, DeepSpeed, FSDP2, TP and PP.

    The global random state is left as it was. ``model`` may be on ``meta`` (the streaming load): the adapters are
    then materialised on the host.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, peft_config)
    on_meta = any(p.is_meta for p in model.parameters())
    if _redrawn(peft_config):
        _redraw(model, peft_config, seed)
    elif on_meta:
        raise ValueError(
            f"init_lora_weights={getattr(peft_config, 'init_lora_weights', True)!r}, "
            f"use_dora={getattr(peft_config, 'use_dora', False)}: these adapters are computed from the base weights, "
            f"which a meta-device load does not hold; use init_lora_weights=True or 'gaussian' without DoRA, or "
            f"transformers' from_pretrained"
        )
    left = [n for n, p in model.named_parameters() if p.requires_grad and p.is_meta]
    if left:
        raise ValueError(f"adapter parameters {left[:4]} have no initialisation on a meta model; use a LoRA config")
    return model


def _redrawn(peft_config) -> bool:
    init = getattr(peft_config, "init_lora_weights", True)
    return init in REDRAWN_INITS and not getattr(peft_config, "use_dora", False)


def _redraw(model: nn.Module, peft_config, seed: int) -> None:
    """PEFT's own ``reset_lora_parameters`` for every LoRA adapter, drawn on the host from ``seed`` in module order
    (adapters on ``meta`` are materialised on the host; others go back to their device afterwards)."""
    init = getattr(peft_config, "init_lora_weights", True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if not (hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A")):
                continue
            for adapter in list(module.lora_A.keys()):
                pair = (module.lora_A[adapter], module.lora_B[adapter])
                device = next(pair[0].parameters()).device
                for part in pair:  # drawn on the host: the same numbers whatever the device
                    if device.type == "meta":
                        part.to_empty(device="cpu")
                    else:
                        part.to("cpu")
                module.reset_lora_parameters(adapter, init)
                if device.type not in ("meta", "cpu"):
                    for part in pair:
                        part.to(device)

"""PEFT wrappers seen from hf_dist: whether a model is a ``PeftModel``, and the transformers model inside it.

One place for the test, so that every layout, loader and saver unwraps the same way. Imports nothing from
hf_dist (any module may use it without an import circle) and does not import ``peft``.
"""

from __future__ import annotations

import re

from torch import nn

_BASE_LAYER = re.compile(r"(?:\.base_layer)+(?=\.)")


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT wrapper (``PeftModel`` and its task subclasses)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def without_base_layers(name: str) -> str:
    """A tensor name as the unwrapped model spells it: PEFT's ``.base_layer`` segments dropped (nested
    ``ParamWrapper``s put several in a row: ``mlp.experts.base_layer.base_layer.gate_up_proj``)."""
    return _BASE_LAYER.sub("", name)


def peft_rank(model: nn.Module) -> int:
    """The largest LoRA rank of ``model``'s adapters (1 for adapters without one); 0 for a plain model."""
    if not is_peft_model(model):
        return 0
    return max((getattr(config, "r", 1) or 1 for config in model.peft_config.values()), default=0)

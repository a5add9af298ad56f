"""Which checkpoint tensor fills which model tensor, by transformers' own renaming rules.

transformers 5 keeps some architectures on disk in another form than in memory, and its loader converts them
(``transformers.conversion_mapping``): Mixtral's experts are stored one tensor per expert
(``block_sparse_moe.experts.3.w1.weight``) and combined into ``mlp.experts.gate_up_proj``; old checkpoints name
LayerNorm parameters ``gamma``/``beta``; a checkpoint of the bare model has no ``model.`` prefix. ``key_map``
asks transformers for the model's rules and applies them with its own ``rename_source_key``, so a tensor that is
only *renamed* streams like any other. A tensor that transformers *assembles* from several checkpoint tensors
(a ``WeightConverter``: concatenation, stacking) is not one slice of one stored tensor; ``KeyMap.assembled``
records, for each, the converter and its source keys in the order transformers' loader feeds them, so
``assembly.py`` can run the converter's own operations. A converter with several targets (one stored tensor split
into several model tensors) is listed in ``KeyMap.unsupported``: the caller must not stream that checkpoint.

Not for: reading slices (``checkpoint_files.py``) or deciding which slice a rank owns (``slices.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class Assembly:
    """How transformers builds one model tensor: its ``WeightConverter`` and the checkpoint keys it reads."""

    converter: Any
    """The model type's ``WeightConverter`` (a template: copy it before feeding it tensors)."""
    pattern: str
    """The converter source pattern that matched first (for messages)."""
    sources: list[tuple[str, str]] = field(default_factory=list)
    """``(checkpoint key, matched source pattern)`` in transformers' loading order (``dot_natural_key``)."""


@dataclass
class KeyMap:
    """Model tensor name (HF, unwrapped) -> the checkpoint tensor it is read from."""

    to_file: dict[str, str] = field(default_factory=dict)
    """Model name -> checkpoint name, for every tensor read as stored (possibly renamed)."""
    assembled: dict[str, Assembly] = field(default_factory=dict)
    """Model name -> the transformers converter that builds it from several checkpoint tensors."""
    unsupported: dict[str, str] = field(default_factory=dict)
    """Model name -> pattern of an assembled tensor whose converter has several targets (not streamed)."""

    def describe_assembly(self, limit: int = 3, *, unsupported: bool = False) -> str:
        """A short list of ``model name <- pattern`` for an error or warning."""
        found = self.unsupported if unsupported else {n: a.pattern for n, a in self.assembled.items()}
        return ", ".join(f"{name} <- {pattern}" for name, pattern in sorted(found.items())[:limit])


def identity_map(checkpoint_keys: list[str]) -> KeyMap:
    """Every checkpoint tensor under its own name (a checkpoint written in the model's in-memory form)."""
    return KeyMap(to_file={key: key for key in checkpoint_keys})


def key_map(model: nn.Module, checkpoint_keys: list[str]) -> KeyMap:
    """The names ``model`` (a transformers ``PreTrainedModel``, on ``meta`` is fine) gives ``checkpoint_keys``.

    Mirrors what ``from_pretrained`` does with the same checkpoint: every renaming rule of the model type applies,
    then at most one conversion; a key already equal to a model name is kept as it is.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    from hf_dist.loading.slices import checkpoint_key

    # meta tensors: names only, no storage; names as stored (PEFT's base_layer and other wrappers removed)
    model_names = {checkpoint_key(name): tensor for name, tensor in model.state_dict().items()}
    prefix = getattr(model, "base_model_prefix", None) or None
    by_pattern = {source: converter for converter in converters for source in converter.source_patterns}
    mapped = KeyMap()
    for key in sorted(checkpoint_keys, key=dot_natural_key):  # the order transformers' loader feeds converters
        name, pattern = rename_source_key(key, renamings, converters, prefix, model_names)
        if name not in model_names and key in model_names:
            name, pattern = key, None
        if name not in model_names:
            continue  # unexpected: reported by the loader
        if pattern is not None and len(by_pattern[pattern].target_patterns) > 1:
            mapped.unsupported.setdefault(name, pattern)
        elif pattern is not None:
            assembly = mapped.assembled.setdefault(name, Assembly(by_pattern[pattern], pattern))
            assembly.sources.append((key, pattern))
        else:
            mapped.to_file.setdefault(name, key)
    return mapped

"""What the config generators need to know about a model, without building or downloading it.

``no_split_modules(model)`` gives the decoder-layer classes FSDP wraps, read from the causal-LM class's
``_no_split_modules``; ``hidden_size(model)`` sizes DeepSpeed buckets. ``model`` is a ``PreTrainedModel`` (or its
class), a ``PretrainedConfig``, a local directory with ``config.json``, or a ``model_type`` name such as
``"llama"`` (the architecture's default config). Nothing is downloaded: a name that is neither a local directory
nor a known model type is an error.

Not here: parameter counts or memory (``hf_dist.planner``).
"""

from __future__ import annotations

import os


def _catalogue_config(name: str):
    """The planner's catalogue entry for ``name`` as a ``PretrainedConfig``, when the planner provides one."""
    try:
        from hf_dist.planner import catalogue  # optional: owned by the planner
    except ImportError:
        return None
    getter = getattr(catalogue, "get_model_config", None)
    if getter is None:
        return None
    try:
        return getter(name)
    except (KeyError, ValueError):
        return None


def load_config(model):
    """A ``PretrainedConfig`` for ``model`` (see the module docstring for what ``model`` may be)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model, PretrainedConfig):
        return model
    config = getattr(model, "config", None) or getattr(model, "config_class", None)
    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, type) and issubclass(config, PretrainedConfig):
        return config()
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        if os.path.isfile(os.path.join(name, "config.json")):
            return AutoConfig.from_pretrained(name, local_files_only=True)
        if name in CONFIG_MAPPING:
            return CONFIG_MAPPING[name]()
        catalogued = _catalogue_config(name)
        if catalogued is not None:
            return catalogued
        raise ValueError(
            f"model={name!r} is neither a local directory with config.json nor a known model_type; pass a local "
            f"model directory, or a model_type such as 'llama', 'mistral' or 'qwen2' (nothing is downloaded)"
        )
    raise ValueError(f"model={model!r} is not a model, config, directory or model_type name")


def no_split_modules(model) -> tuple[str, ...]:
    """The layer classes that must not be split across FSDP units (the causal LM's ``_no_split_modules``)."""
    classes = getattr(model, "_no_split_modules", None)
    if classes:
        return tuple(classes)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = load_config(model)
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(
            f"model_type={config.model_type!r} has no causal-LM class in transformers; pass no_split_modules "
            f"(the decoder-layer class names) explicitly"
        ) from None
    classes = getattr(model_class, "_no_split_modules", None)
    if not classes:
        raise ValueError(
            f"{model_class.__name__} declares no _no_split_modules; pass no_split_modules (the decoder-layer class "
            f"names) explicitly"
        )
    return tuple(classes)


def hidden_size(model) -> int:
    """The model's hidden size (for DeepSpeed bucket sizes)."""
    config = load_config(model)
    size = getattr(config, "hidden_size", None)
    if size is None:
        raise ValueError(f"model_type={config.model_type!r} has no hidden_size in its config")
    return int(size)

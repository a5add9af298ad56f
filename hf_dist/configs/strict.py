"""Reading config files back, strictly: an unknown key is a ``ValueError`` naming the key, the file and the
nearest valid key (``difflib``), never a silent default.

* ``read_layout_file`` -- hf_dist's own ``hf_dist.yaml`` (keys: the ``Layout`` fields), returned as a ``LaunchSpec``.
* ``read_accelerate_config`` -- an accelerate YAML. accelerate itself refuses unknown top-level keys but copies
  nested sections (``fsdp_config``, ``deepspeed_config``, ...) onto its launch arguments without a check, so a
  typo such as ``fsdp_activation_checkpoiting`` is silently dropped there. Here every section is checked against
  the options of accelerate's own ``launch`` parser.
* ``read_deepspeed_config`` -- a DeepSpeed JSON. DeepSpeed ignores unknown top-level keys; here they are errors
  (``DEEPSPEED_TOP_LEVEL_KEYS``), and ``zero_optimization`` is checked against DeepSpeed's own ZeRO model.

Not here: generating files (``hf_dist.configs.launch``) or judging whether values are sensible beyond the
batch arithmetic.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from hf_dist.configs.deepspeed import check_batch_arithmetic
from hf_dist.configs.launch import LaunchSpec
from hf_dist.strategy import Layout

# Top-level keys of a DeepSpeed config (DeepSpeed's config-json documentation and deepspeed/runtime/config.py).
DEEPSPEED_TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "fp16", "bf16", "amp", "torch_autocast", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "seq_parallel_communication_data_type", "sparse_gradients", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "aio", "steps_per_print",
    "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler", "activation_checkpointing",
    "sparse_attention", "data_efficiency", "curriculum_learning", "checkpoint", "data_types", "elasticity",
    "compression_training", "autotuning", "nebula", "pipeline", "tensor_parallel", "tensorboard", "wandb",
    "csv_monitor", "comet", "comms_logger", "monitor_config", "weight_quantization", "hybrid_engine", "compile",
    "timers", "eigenvalue", "progressive_layer_drop", "quantize_training", "sequence_parallel_size",
    "disable_allgather", "dataloader_drop_last", "use_data_before_expert_parallelism", "graph_harvesting",
    "gradient_allreduce_op", "zero_legacy_stage1", "mics_shard_size", "mics_hierarchical_params_gather",
    "expert_parallel", "vocabulary_size", "sparse_attention_config", "fp8",
})
# Nested accelerate sections -> the title of the accelerate-launch argument group their keys come from.
_ACCELERATE_SECTIONS: dict[str, tuple[str, str]] = {
    "fsdp_config": ("FSDP Arguments", "fsdp_"),
    "deepspeed_config": ("DeepSpeed Arguments", ""),
    "parallelism_config": ("ParallelismConfig Arguments", ""),
    "megatron_lm_config": ("Megatron-LM Arguments", ""),
    "fp8_config": ("FP8 Arguments", "fp8_"),
    "dynamo_config": ("Resource Selection Arguments", "dynamo_"),
    "mpirun_config": ("MPI Arguments", ""),
}


def unknown_key_error(key: str, valid: Iterable[str], *, where: str, path: str | Path) -> ValueError:
    """The error for an unknown ``key``: names the key, the section, the file and the nearest valid key."""
    valid = sorted(valid)
    near = nearest_key(key, valid)
    hint = f"did you mean {near!r}? " if near else ""
    return ValueError(
        f"{path}: unknown key {key!r} in {where}; {hint}valid keys: {', '.join(valid)}"
    )


def nearest_key(key: str, valid: Iterable[str]) -> str | None:
    """The valid key closest to ``key``: a close spelling (difflib), else one that contains or is contained in it
    (``tp_size`` -> ``tp``)."""
    valid = sorted(valid)
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if near:
        return near[0]
    related = [v for v in valid if v in key or key in v]
    return max(related, key=len) if related else None


def check_keys(mapping: Mapping, valid: Iterable[str], *, where: str, path: str | Path) -> None:
    """Raise ``unknown_key_error`` for the first key of ``mapping`` not in ``valid``."""
    valid = set(valid)
    for key in mapping:
        if key not in valid:
            raise unknown_key_error(str(key), valid, where=where, path=path)


def _load_mapping(path: str | Path, loader) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = loader(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of keys to values at the top level, got {type(data).__name__}")
    return data


# -- hf_dist.yaml ---------------------------------------------------------------------------------------------
def read_layout_file(path: str | Path) -> LaunchSpec:
    """Read ``hf_dist.yaml`` back into a ``LaunchSpec``; unknown keys and invalid values are ``ValueError``s."""
    data = _load_mapping(path, yaml.safe_load)
    keys = [f.name for f in dataclasses.fields(Layout)] + [f.name for f in dataclasses.fields(LaunchSpec)
                                                           if f.name != "layout"]
    check_keys(data, keys, where="the hf_dist layout", path=path)
    if data.get("no_split_modules") is not None:
        data["no_split_modules"] = tuple(data["no_split_modules"])
    try:
        return LaunchSpec.from_flat(**data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


# -- accelerate YAML -------------------------------------------------------------------------------------------
def _accelerate_keys() -> tuple[set[str], dict[str, set[str]]]:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    groups = {group.title: {a.dest for a in group._group_actions} for group in parser._action_groups}
    top = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}  # legacy keys accelerate converts
    sections: dict[str, set[str]] = {}
    for section, (title, prefix) in _ACCELERATE_SECTIONS.items():
        keys = {d for d in groups[title] if d.startswith(prefix)}
        # accelerate adds the prefix itself when a key lacks it
        sections[section] = keys | {k.removeprefix(prefix) for k in keys} if prefix else keys
    sections["fsdp_config"] |= {"fsdp_ignored_modules", "ignored_modules"}  # read by accelerate via getattr
    return top, sections


def read_accelerate_config(path: str | Path) -> dict:
    """Read an accelerate YAML, refusing unknown keys at any level; returns the raw mapping."""
    data = _load_mapping(path, yaml.safe_load)
    top, sections = _accelerate_keys()
    check_keys(data, top, where="the accelerate config (top level)", path=path)
    for section, valid in sections.items():
        value = data.get(section)
        if isinstance(value, dict):
            check_keys(value, valid, where=section, path=path)
    _check_deepspeed_file_section(data, path)
    if data.get("distributed_type") == "MULTI_CPU" or data.get("use_cpu"):
        raise ValueError(
            f"{path}: distributed_type=MULTI_CPU / use_cpu=true makes `accelerate launch` start ONE process; "
            f"write distributed_type: MULTI_GPU (accelerate runs MULTI_CPU over gloo when there is no GPU)"
        )
    return data


# Keys accelerate refuses next to a deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks): the JSON owns them.
_OWNED_BY_DEEPSPEED_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                            "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                            "zero3_save_16bit_model")


def _check_deepspeed_file_section(data: dict, path: str | Path) -> None:
    section = data.get("deepspeed_config")
    if not isinstance(section, dict) or not section.get("deepspeed_config_file"):
        return
    clash = [k for k in _OWNED_BY_DEEPSPEED_FILE if k in section]
    if data.get("mixed_precision") is not None:
        clash.append("mixed_precision")
    if clash:
        raise ValueError(
            f"{path}: {', '.join(clash)} next to deepspeed_config_file; accelerate refuses this when each process "
            f"starts (the DeepSpeed JSON owns these values): remove them from the YAML and set them in the JSON"
        )


# -- DeepSpeed JSON --------------------------------------------------------------------------------------------
def _zero_keys() -> dict[str, set[str]] | None:
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.runtime.zero.offload_config import (
            DeepSpeedZeroOffloadOptimizerConfig,
            DeepSpeedZeroOffloadParamConfig,
        )
    except ImportError:  # DeepSpeed is optional: check the top level only
        return None

    def names(model) -> set[str]:
        out = set()
        for name, info in model.model_fields.items():
            out.add(name)
            if info.alias:
                out.add(info.alias)
        return out

    return {
        "zero_optimization": names(DeepSpeedZeroConfig),
        "zero_optimization.offload_optimizer": names(DeepSpeedZeroOffloadOptimizerConfig),
        "zero_optimization.offload_param": names(DeepSpeedZeroOffloadParamConfig),
    }


def read_deepspeed_config(path: str | Path, *, dp: int | None = None) -> dict:
    """Read a DeepSpeed JSON, refusing unknown keys; with ``dp``, also check the resolved batch arithmetic."""
    data = _load_mapping(path, json.load)
    check_keys(data, DEEPSPEED_TOP_LEVEL_KEYS, where="the DeepSpeed config (top level)", path=path)
    zero = data.get("zero_optimization")
    nested = _zero_keys()
    if isinstance(zero, dict) and nested is not None:
        check_keys(zero, nested["zero_optimization"], where="zero_optimization", path=path)
        for block in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(block), dict):
                where = f"zero_optimization.{block}"
                check_keys(zero[block], nested[where], where=where, path=path)
    check_batch_arithmetic(data, dp=dp, source=str(path))
    return data


def read_config_file(path: str | Path) -> object:
    """Read any file hf_dist writes, by name: ``hf_dist.yaml``, ``*.json`` (DeepSpeed), ``*.yaml`` (accelerate)."""
    path = Path(path)
    if path.name == "hf_dist.yaml":
        return read_layout_file(path)
    if path.suffix == ".json":
        return read_deepspeed_config(path)
    if path.suffix in (".yaml", ".yml"):
        return read_accelerate_config(path)
    raise ValueError(f"{path}: not a config hf_dist reads (hf_dist.yaml, a DeepSpeed .json or an accelerate .yaml)")


def read_layout_dir(folder: str | Path) -> LaunchSpec:
    """Read a folder written by ``write_layout_configs`` and check that its files agree with each other."""
    from hf_dist.configs.launch import ACCELERATE_FILE, DEEPSPEED_FILE, LAYOUT_FILE

    folder = Path(folder)
    layout = read_layout_file(folder / LAYOUT_FILE)
    acc_path = folder / ACCELERATE_FILE
    acc = read_accelerate_config(acc_path)
    expected = {"num_processes": layout.world_size, "num_machines": layout.num_nodes}
    if not layout.is_deepspeed:  # a DeepSpeed YAML carries no precision: its JSON does
        expected["mixed_precision"] = layout.mixed_precision
    for key, value in expected.items():
        if acc.get(key) != value:
            raise ValueError(f"{acc_path}: {key}={acc.get(key)!r} disagrees with {LAYOUT_FILE} ({key}={value!r}); "
                             f"regenerate the folder with hf-dist config")
    if layout.is_deepspeed:
        ds_path = folder / DEEPSPEED_FILE
        ds = read_deepspeed_config(ds_path, dp=layout.dp)
        checks = {
            "train_micro_batch_size_per_gpu": (ds.get("train_micro_batch_size_per_gpu"), layout.micro_batch_size),
            "gradient_accumulation_steps": (ds.get("gradient_accumulation_steps"), layout.gradient_accumulation_steps),
            # an absent precision block is a disabled one
            "bf16.enabled": (ds.get("bf16", {}).get("enabled", False), layout.mixed_precision == "bf16"),
            "fp16.enabled": (ds.get("fp16", {}).get("enabled", False), layout.mixed_precision == "fp16"),
        }
        for key, (found, value) in checks.items():
            if found not in ("auto", value):
                raise ValueError(f"{ds_path}: {key}={found!r} disagrees with {LAYOUT_FILE} (which implies {value!r}); "
                                 f"regenerate the folder with hf-dist config")
    return layout

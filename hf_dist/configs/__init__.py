"""Config generation: DeepSpeed JSON, accelerate YAML and hf_dist's layout file, from typed specs.

* ``deepspeed`` -- ``DeepSpeedSpec`` -> DeepSpeed config dict (Trainer "auto" mode or fully resolved).
* ``accelerate`` -- ``AccelerateSpec`` -> accelerate config dict / YAML (DDP, FSDP1/2, DeepSpeed, multi-node).
* ``layout`` -- ``LaunchSpec`` (a ``hf_dist.strategy.Layout`` x batch x precision) -> the folder of files that
  launches it;
  ``write_layout_configs`` is what ``hf-dist plan --out`` and ``hf-dist config`` call.
* ``strict`` -- reading files back: unknown keys are errors naming the key, the file and the nearest valid key.
* ``ship`` -- the files shipped in ``ds_configs/`` and ``accelerate_configs/`` (``python -m hf_dist.configs.ship``).

Not here: choosing a layout or estimating memory (``hf_dist.planner``).
"""

from hf_dist.configs.accelerate import AccelerateSpec, DeepSpeedLaunchSpec, FsdpSpec, accelerate_config, to_yaml
from hf_dist.configs.deepspeed import (
    TRAINER_OWNED_KEYS,
    AdamWSettings,
    DeepSpeedBatch,
    DeepSpeedSpec,
    deepspeed_config,
)
from hf_dist.configs.launch import LaunchSpec, layout_files, write_layout_configs
from hf_dist.configs.strict import (
    read_accelerate_config,
    read_config_file,
    read_deepspeed_config,
    read_layout_dir,
    read_layout_file,
)

__all__ = [
    "TRAINER_OWNED_KEYS",
    "AccelerateSpec",
    "AdamWSettings",
    "DeepSpeedBatch",
    "DeepSpeedLaunchSpec",
    "DeepSpeedSpec",
    "FsdpSpec",
    "LaunchSpec",
    "accelerate_config",
    "deepspeed_config",
    "layout_files",
    "read_accelerate_config",
    "read_config_file",
    "read_deepspeed_config",
    "read_layout_dir",
    "read_layout_file",
    "to_yaml",
    "write_layout_configs",
]

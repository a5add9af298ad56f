"""Shipped configs: generated (no drift), accepted by DeepSpeed's and accelerate's own config classes.

The CPU launch tests that train with each kind are ``tests/test_launch*.py``; nothing is launched here.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from dist_utils import launcher_env
from hf_dist.configs import ship
from hf_dist.configs.strict import read_accelerate_config, read_deepspeed_config

ROOT = Path(__file__).resolve().parent.parent
DS_FILES = sorted((ROOT / "ds_configs").glob("*.json"))
YAML_FILES = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
CPU_TWIN = ("ddp.yaml", "fsdp.yaml", "zero2.yaml", "zero3.yaml")


def test_shipped_files_are_generated_without_drift(tmp_path):
    written = ship.regenerate(tmp_path)
    assert len(written) == len(DS_FILES) + len(YAML_FILES)
    for path in written:
        rel = path.relative_to(tmp_path)
        assert (ROOT / rel).read_text() == path.read_text(), f"{rel} drifted: run python -m hf_dist.configs.ship"
    assert ship.drift(ROOT) == []


def test_drift_is_reported(tmp_path):
    ship.regenerate(tmp_path)
    (tmp_path / "ds_configs" / "zero2.json").write_text("{}\n")
    (tmp_path / "accelerate_configs" / "hand_made.yaml").write_text("distributed_type: MULTI_GPU\n")
    (tmp_path / "accelerate_configs" / "ddp.yaml").unlink()
    assert ship.drift(tmp_path) == [
        "changed: ds_configs/zero2.json",
        "missing: accelerate_configs/ddp.yaml",
        "not generated: accelerate_configs/hand_made.yaml",
    ]
    assert ship.main([str(tmp_path), "--check"]) == 1


class _Model:
    class config:  # noqa: N801 -- mimics model.config
        hidden_size = 64


def _dp_world(dp: int):
    """DeepSpeedConfig reads the data-parallel world from the process group; give it ``dp`` without one."""

    class Mpu:
        def get_data_parallel_world_size(self):
            return dp

    return Mpu()


def _through_trainer_and_deepspeed(config: dict, *, micro: int, accum: int, world: int, precision: str = "bf16"):
    """Fill ``config`` as the HF Trainer does for these arguments, then build DeepSpeed's own config object."""
    from deepspeed.runtime import config as ds_config_module
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(output_dir="/tmp/unused", per_device_train_batch_size=micro,
                             gradient_accumulation_steps=accum, bf16=precision == "bf16", fp16=precision == "fp16",
                             use_cpu=precision != "fp16", report_to=[])
    hf_config = HfTrainerDeepSpeedConfig(config)
    with mock.patch.object(TrainingArguments, "world_size", new_callable=mock.PropertyMock, return_value=world):
        hf_config.trainer_config_process(args)
        hf_config.trainer_config_finalize(args, _Model, 100)  # raises on any mismatch with the arguments
    assert "auto" not in json.dumps(hf_config.config)
    with mock.patch.object(ds_config_module.dist, "get_rank", return_value=0):
        return ds_config_module.DeepSpeedConfig(hf_config.config, mpu=_dp_world(world))


@pytest.mark.parametrize("path", DS_FILES, ids=lambda p: p.name)
def test_deepspeed_json_passes_deepspeed_after_trainer_filling(path):
    raw = read_deepspeed_config(path)
    if raw["train_batch_size"] == "auto":
        micro, accum, world = 2, 3, 1
    else:
        micro, accum = raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"]
        world = raw["train_batch_size"] // (micro * accum)
    ds = _through_trainer_and_deepspeed(json.loads(path.read_text()), micro=micro, accum=accum, world=world)
    assert ds.train_batch_size == micro * accum * world
    assert ds.zero_optimization_stage == raw["zero_optimization"]["stage"]
    assert ds.bfloat16_config.enabled is True
    if ds.zero_optimization_stage == 3:
        assert ds.zero_config.gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize("strategy, offload, precision", [
    ("zero1", None, "bf16"), ("zero2", "cpu", "fp16"), ("zero3", "nvme", "bf16"), ("zero3", None, "no"),
])
def test_resolved_layout_json_passes_deepspeed(tmp_path, strategy, offload, precision):
    from hf_dist.configs import write_layout_configs

    write_layout_configs(tmp_path, strategy=strategy, num_gpus=8, num_nodes=2, micro_batch_size=2,
                         gradient_accumulation_steps=3, mixed_precision=precision, offload=offload)
    config = json.loads((tmp_path / "deepspeed.json").read_text())
    ds = _through_trainer_and_deepspeed(config, micro=2, accum=3, world=16, precision=precision)
    assert ds.train_batch_size == 2 * 3 * 16
    assert ds.bfloat16_config.enabled is (precision == "bf16")
    assert ds.float16_config.enabled is (precision == "fp16")
    if offload:
        assert ds.zero_config.offload_optimizer.device == offload


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_accelerate_yaml_loads_with_accelerates_loader(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    raw = read_accelerate_config(path)
    assert config.use_cpu is False and config.distributed_type.value != "MULTI_CPU"
    assert config.num_processes % config.num_machines == 0
    if raw["distributed_type"] == "DEEPSPEED":
        ds_file = ROOT / config.deepspeed_config["deepspeed_config_file"]
        assert ds_file.is_file(), f"{path.name} points at a missing {ds_file}"
    if raw["distributed_type"] == "FSDP":
        assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert "fsdp_transformer_layer_cls_to_wrap" not in config.fsdp_config  # the model's _no_split_modules
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_cpu_twin_configs_start_two_processes_without_cpu_flags():
    for name in CPU_TWIN:
        raw = read_accelerate_config(ROOT / "accelerate_configs" / name)
        assert raw["num_processes"] == 2 and "use_cpu" not in raw
        if raw["distributed_type"] == "DEEPSPEED":  # precision comes from the JSON: "auto", i.e. the Trainer's
            assert "mixed_precision" not in raw
            ds = read_deepspeed_config(ROOT / raw["deepspeed_config"]["deepspeed_config_file"])
            assert ds["bf16"]["enabled"] == ds["fp16"]["enabled"] == "auto"
        else:
            assert raw["mixed_precision"] == "no"
    fsdp = read_accelerate_config(ROOT / "accelerate_configs" / "fsdp.yaml")["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False  # fails on a machine without GPU


@pytest.mark.parametrize("path", [p for p in YAML_FILES if "fsdp1" not in p.name], ids=lambda p: p.name)
def test_yaml_builds_accelerates_plugin_in_the_launched_process(path):
    """Each process builds its FSDP/DeepSpeed plugin from the launcher's environment; that must not fail.

    (FSDP1 plugins need a GPU to build, so the FSDP1 file is checked by the loader test only.)
    """
    import os

    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    args, env = launcher_env(path)
    raw = read_accelerate_config(path)
    with mock.patch.dict(os.environ, env):
        if args.use_deepspeed:
            plugin = DeepSpeedPlugin()
            ds = json.loads((ROOT / raw["deepspeed_config"]["deepspeed_config_file"]).read_text())
            assert plugin.zero_stage == ds["zero_optimization"]["stage"]
            assert plugin.zero3_init_flag is raw["deepspeed_config"]["zero3_init_flag"]
            # real GPUs build ZeRO-3 models partitioned; the CPU twin builds normally (parity of initial weights)
            assert plugin.zero3_init_flag is (plugin.zero_stage == 3 and path.name not in CPU_TWIN)
        elif args.use_fsdp:
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == raw["fsdp_config"]["fsdp_version"]
            assert plugin.activation_checkpointing is raw["fsdp_config"]["fsdp_activation_checkpointing"]
            if raw.get("parallelism_config"):
                from accelerate.parallelism_config import ParallelismConfig

                mesh = ParallelismConfig()
                assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (2, 8)
        else:
            assert args.multi_gpu and env.get("ACCELERATE_USE_FSDP") is None


@pytest.mark.parametrize("name, reshard, checkpointing", [
    ("fsdp.yaml", True, False),
    ("harbor_13b_fsdp_8gpu.yaml", True, True),
    ("harbor_13b_fsdp_grad_op_8gpu.yaml", False, True),
])
def test_fsdp2_yaml_reaches_hf_dists_trainer_as_written(name, reshard, checkpointing):
    """accelerate's launcher turns the YAML into FSDP_* variables (writer); hf_dist's trainer reads them (reader)."""
    import os

    from hf_dist.trainer.launch_env import read_fsdp_request

    _, env = launcher_env(ROOT / "accelerate_configs" / name)
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    with mock.patch.dict(os.environ, env):
        version, request = read_fsdp_request(None)
    assert version == 2
    assert request.reshard_after_forward is reshard
    assert request.activation_checkpointing is checkpointing
    assert request.wrap_classes is None  # no class named: the model's own _no_split_modules
    assert request.cpu_offload is False


def _tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type, layer", [
    ("llama", "LlamaDecoderLayer"), ("qwen2", "Qwen2DecoderLayer"), ("gpt_neox", "GPTNeoXLayer"),
])
def test_shipped_fsdp_yaml_shards_each_models_own_layers(model_type, layer):
    """fsdp.yaml, through the launcher's environment and hf_dist's reader, picks each model's decoder layer."""
    import os

    from hf_dist.parallelism import find_blocks
    from hf_dist.trainer.launch_env import read_fsdp_request

    _, env = launcher_env(ROOT / "accelerate_configs" / "fsdp.yaml")
    with mock.patch.dict(os.environ, env):
        _, request = read_fsdp_request(None)
    blocks = find_blocks(_tiny(model_type), request.wrap_classes)
    assert [type(b).__name__ for b in blocks] == [layer, layer]


def test_a_named_wrap_class_stops_other_models():
    """What the shipped file did before: LlamaDecoderLayer named, a Qwen2 model refused (now only when asked)."""
    from hf_dist.parallelism import find_blocks

    with pytest.raises(ValueError, match=r"no module of class \['LlamaDecoderLayer'\] in Qwen2ForCausalLM.*"
                                         r"Qwen2DecoderLayer"):
        find_blocks(_tiny("qwen2"), ("LlamaDecoderLayer",))

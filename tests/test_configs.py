"""Config generators, layouts and strict readers: pure tests (no process group, no DeepSpeed engine)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import transformers.integrations.deepspeed as hf_ds
from hf_dist.configs import (
    TRAINER_OWNED_KEYS,
    DeepSpeedBatch,
    DeepSpeedSpec,
    FsdpSpec,
    LaunchSpec,
    deepspeed_config,
    write_layout_configs,
)
from hf_dist.configs.deepspeed import check_batch_arithmetic
from hf_dist.configs.model_info import hidden_size, no_split_modules
from hf_dist.configs.strict import (
    read_accelerate_config,
    read_deepspeed_config,
    read_layout_dir,
    read_layout_file,
)

LLAMA = ("LlamaDecoderLayer",)


def _dotted(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_dotted(value, name + "."))
        else:
            out[name] = value
    return out


# -- DeepSpeed generator --------------------------------------------------------------------------------------
def test_trainer_owned_keys_are_the_ones_transformers_fills():
    source = Path(hf_ds.__file__).read_text()
    body = source[source.index("def trainer_config_process"):source.index("# keep the config object global")]
    filled = set(re.findall(r'fill_(?:match|only)\(\s*"([a-z0-9_.]+)"', body))
    assert filled == set(TRAINER_OWNED_KEYS)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", [None, "cpu", "nvme"])
def test_auto_only_for_trainer_owned_keys(stage, offload):
    spec = DeepSpeedSpec(stage=stage, offload_optimizer=offload, offload_param=offload if stage == 3 else None,
                         optimizer="deepspeed" if offload else "trainer")
    flat = _dotted(deepspeed_config(spec))
    autos = {key for key, value in flat.items() if value == "auto"}
    assert autos <= set(TRAINER_OWNED_KEYS)
    assert {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "bf16.enabled", "fp16.enabled"} <= autos
    assert flat["zero_optimization.stage"] == stage
    if offload:
        assert flat["zero_optimization.offload_optimizer.device"] == offload
    if offload == "nvme":
        assert flat["zero_optimization.offload_optimizer.nvme_path"] == "/local_nvme"
        assert "aio.block_size" in flat
    if stage == 3:
        assert flat["zero_optimization.stage3_gather_16bit_weights_on_model_save"] is True


def test_resolved_config_has_numbers_and_the_trainer_bucket_formulas():
    batch = DeepSpeedBatch(micro_batch_size=2, gradient_accumulation_steps=4, dp=8, gradient_clipping=0.5,
                           hidden_size=64)
    config = deepspeed_config(DeepSpeedSpec(stage=3, precision="bf16", batch=batch))
    assert config["train_batch_size"] == 2 * 4 * 8
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640
    assert "auto" not in json.dumps(config)


def test_fp16_carries_dynamic_loss_scaling():
    config = deepspeed_config(DeepSpeedSpec(stage=2, precision="fp16",
                                            batch=DeepSpeedBatch(micro_batch_size=1, gradient_accumulation_steps=1,
                                                                 dp=2)))
    assert "bf16" not in config
    assert config["fp16"]["enabled"] is True and config["fp16"]["loss_scale"] == 0
    assert config["fp16"]["initial_scale_power"] == 16 and config["fp16"]["hysteresis"] == 2


def test_resolved_config_is_checked_by_the_trainer():
    config = deepspeed_config(DeepSpeedSpec(stage=2, precision="fp32", batch=DeepSpeedBatch(
        micro_batch_size=4, gradient_accumulation_steps=2, dp=1, hidden_size=64)))
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="/tmp/unused", per_device_train_batch_size=3, gradient_accumulation_steps=2,
                             use_cpu=True, report_to=[])
    hf_config = hf_ds.HfTrainerDeepSpeedConfig(config)
    hf_config.trainer_config_process(args)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=3"):
        hf_config.trainer_config_finalize(args, None, 10)


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 2, "offload_param": "cpu"}, "offload_param='cpu' needs ZeRO stage 3"),
    ({"stage": 4}, "stage=4 is not a ZeRO stage"),
    ({"stage": 3, "precision": "auto", "batch": DeepSpeedBatch(micro_batch_size=1, gradient_accumulation_steps=1,
                                                              dp=1)}, "must name it"),
    ({"stage": 1, "extra": {"train_batch_size": 8}}, "written by the spec itself"),
])
def test_deepspeed_spec_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        deepspeed_config(DeepSpeedSpec(**kwargs))


def test_batch_arithmetic_names_all_four():
    bad = {"train_batch_size": 60, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8}
    with pytest.raises(ValueError, match=r"train_batch_size=60 .* x dp=8 \(= 64\)"):
        check_batch_arithmetic(bad, dp=8)
    check_batch_arithmetic({**bad, "train_batch_size": 64}, dp=8)


# -- layouts ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "fsdp"}, "strategy='fsdp' is not known"),
    ({"strategy": "ddp", "offload": "cpu"}, "DDP replicates everything"),
    ({"strategy": "fsdp_full_shard", "offload": "nvme", "no_split_modules": LLAMA}, "FSDP offloads .* to CPU only"),
    ({"strategy": "zero2", "offload": "nvme"}, "NVMe .* only at ZeRO-3"),
    ({"strategy": "zero3", "tp": 2}, "does not compose with hf_dist's TP/PP"),
    ({"strategy": "fsdp_hybrid_shard", "no_split_modules": LLAMA}, "dp_replicate >= 2 groups"),
    ({"strategy": "fsdp_full_shard"}, "needs no_split_modules"),
    ({"strategy": "ddp", "tp": 3}, r"tp_size=3 does not divide the 8 processes per node.* use tp_size in \[1, 2, 4, 8\]"),
    ({"strategy": "ddp", "tp": 2, "pp": 2, "sequence_parallel": True}, "not available with pp_size=2"),
    ({"strategy": "ddp", "micro_batch_size": 0}, "micro_batch_size=0 must be a positive integer"),
])
def test_layout_refuses(kwargs, match):
    base = {"num_gpus": 8, "micro_batch_size": 1, "gradient_accumulation_steps": 1}
    values = {**base, **kwargs}
    with pytest.raises(ValueError, match=match):
        LaunchSpec.from_flat(**values)


def test_layout_mesh_and_global_batch():
    hybrid = LaunchSpec.from_flat(strategy="fsdp_hybrid_shard", num_gpus=8, num_nodes=2, micro_batch_size=1,
                                  gradient_accumulation_steps=4, no_split_modules=LLAMA)
    assert (hybrid.layout.dims.dp_replicate, hybrid.layout.dims.dp_shard) == (2, 8)
    tp = LaunchSpec.from_flat(strategy="fsdp_full_shard", num_gpus=8, num_nodes=2, micro_batch_size=2,
                              gradient_accumulation_steps=2, tp=4, no_split_modules=LLAMA)
    assert (tp.dp, tp.layout.dims.tp, tp.global_batch_size) == (4, 4, 2 * 2 * 4)
    ddp = LaunchSpec.from_flat(strategy="ddp", num_gpus=4, micro_batch_size=1, gradient_accumulation_steps=1)
    assert (ddp.layout.dims.dp_replicate, ddp.layout.dims.dp_shard) == (4, 1)


def test_write_layout_configs_round_trips(tmp_path):
    out = tmp_path / "zero3"
    paths = write_layout_configs(out, strategy="zero3", num_gpus=8, num_nodes=2, micro_batch_size=2,
                                 gradient_accumulation_steps=4, offload="cpu")
    assert sorted(p.name for p in paths) == ["accelerate.yaml", "deepspeed.json", "hf_dist.yaml", "launch.sh"]
    layout = read_layout_dir(out)
    assert (layout.strategy, layout.world_size, layout.dp, layout.offload) == ("zero3", 16, 16, "cpu")
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ds["train_batch_size"] == 2 * 4 * 16
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str((out / "deepspeed.json").resolve())
    assert acc["deepspeed_config"]["zero3_init_flag"] is True and acc["num_machines"] == 2
    assert "main_process_ip" not in acc  # left to the launcher
    launch = (out / "launch.sh").read_text()
    assert "--machine_rank" in launch and "MAIN_PROCESS_IP" in launch
    assert "--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --bf16 --activation_checkpointing" in launch


def test_fsdp_layout_carries_tp_in_the_command_and_checkpointing_in_fsdp(tmp_path):
    write_layout_configs(tmp_path, strategy="fsdp_full_shard", num_gpus=8, micro_batch_size=1,
                         gradient_accumulation_steps=8, tp=2, pp=2, no_split_modules=list(LLAMA))
    acc = read_accelerate_config(tmp_path / "accelerate.yaml")
    assert acc["fsdp_config"]["fsdp_activation_checkpointing"] is True
    assert acc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    launch = (tmp_path / "launch.sh").read_text()
    assert "--tp_size 2 --pp_size 2" in launch and "--activation_checkpointing" not in launch
    assert read_layout_file(tmp_path / "hf_dist.yaml").layout.tp == 2


def test_fsdp_versions_and_hybrid_mesh():
    from hf_dist.configs import AccelerateSpec, accelerate_config

    v1 = accelerate_config(AccelerateSpec(num_processes=8, fsdp=FsdpSpec(version=1, sharding="SHARD_GRAD_OP",
                                                                           wrap_classes=LLAMA)))
    assert v1["fsdp_config"]["fsdp_sharding_strategy"] == v1["fsdp_config"]["fsdp_reshard_after_forward"]
    v2 = accelerate_config(AccelerateSpec(num_processes=16, num_machines=2, main_process_ip="10.0.0.1",
                                          main_process_port=29500,
                                          fsdp=FsdpSpec(sharding="HYBRID_SHARD", replicate_size=2,
                                                        wrap_classes=LLAMA)))
    assert v2["fsdp_config"]["fsdp_reshard_after_forward"] is True
    assert v2["parallelism_config"]["parallelism_config_dp_replicate_size"] == 2
    assert v2["parallelism_config"]["parallelism_config_dp_shard_size"] == 8
    assert (v2["main_process_ip"], v2["main_process_port"]) == ("10.0.0.1", 29500)
    grad_op = accelerate_config(AccelerateSpec(num_processes=2, fsdp=FsdpSpec(sharding="SHARD_GRAD_OP",
                                                                              wrap_classes=LLAMA)))
    assert grad_op["fsdp_config"]["fsdp_reshard_after_forward"] is False


# -- strict readers -----------------------------------------------------------------------------------------
def test_layout_file_unknown_key_names_key_file_and_nearest(tmp_path):
    write_layout_configs(tmp_path, strategy="ddp", num_gpus=2, micro_batch_size=1, gradient_accumulation_steps=1)
    path = tmp_path / "hf_dist.yaml"
    data = yaml.safe_load(path.read_text())
    data["tp_size"] = data.pop("tp")
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: unknown key 'tp_size' .*did you mean 'tp'"):
        read_layout_file(path)


def test_deepspeed_unknown_keys(tmp_path):
    path = tmp_path / "ds.json"
    config = deepspeed_config(DeepSpeedSpec(stage=3))
    config["train_micro_batch_size_per_gpus"] = config.pop("train_micro_batch_size_per_gpu")
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="did you mean 'train_micro_batch_size_per_gpu'"):
        read_deepspeed_config(path)
    config = deepspeed_config(DeepSpeedSpec(stage=3))
    config["zero_optimization"]["stage3_gather_16bit_weights_on_save"] = True
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="in zero_optimization; did you mean 'stage3_gather_16bit_weights_on_model_save"):
        read_deepspeed_config(path)


def test_accelerate_unknown_keys_and_single_process_trap(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_proceses": 2}))
    with pytest.raises(ValueError, match="unknown key 'num_proceses' .*did you mean 'num_processes'"):
        read_accelerate_config(path)
    path.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stag": 2}}))
    with pytest.raises(ValueError, match="in deepspeed_config; did you mean 'zero_stage'"):
        read_accelerate_config(path)
    path.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                                    "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero_stage": 2}}))
    with pytest.raises(ValueError, match="zero_stage, mixed_precision next to deepspeed_config_file"):
        read_accelerate_config(path)
    path.write_text(yaml.safe_dump({"distributed_type": "MULTI_CPU", "num_processes": 2}))
    with pytest.raises(ValueError, match="start ONE process"):
        read_accelerate_config(path)


def test_layout_dir_disagreement_is_refused(tmp_path):
    write_layout_configs(tmp_path, strategy="zero2", num_gpus=4, micro_batch_size=1, gradient_accumulation_steps=2)
    acc = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    acc["num_processes"] = 8
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    with pytest.raises(ValueError, match="num_processes=8 disagrees with hf_dist.yaml"):
        read_layout_dir(tmp_path)


# -- model info ---------------------------------------------------------------------------------------------
def test_no_split_modules_from_name_config_and_directory(tmp_path):
    from hf_dist.models.tiny import tiny_llama_config

    assert no_split_modules("llama") == LLAMA
    assert no_split_modules("qwen2") == ("Qwen2DecoderLayer",)
    config = tiny_llama_config()
    config.save_pretrained(tmp_path)
    assert no_split_modules(str(tmp_path)) == LLAMA
    assert hidden_size(str(tmp_path)) == config.hidden_size
    with pytest.raises(ValueError, match="nothing is downloaded"):
        no_split_modules("meta-llama/Llama-2-13b-hf")


# -- CLI ------------------------------------------------------------------------------------------------------
def test_cli_config_writes_a_named_layout(tmp_path, capsys):
    from hf_dist.cli import main

    out = tmp_path / "harbor"
    assert main(["config", "--strategy", "fsdp_full_shard", "--gpus", "8", "--nodes", "2", "--micro-batch", "1",
                 "--global-batch", "64", "--model", "llama-2-13b", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "micro 1 x accumulation 4 x dp 16 = global batch 64" in printed
    layout = read_layout_dir(out)
    assert (layout.no_split_modules, layout.gradient_accumulation_steps, layout.num_nodes) == (LLAMA, 4, 2)
    assert main(["config", "--check", str(out), str(out / "accelerate.yaml")]) == 0


def test_cli_config_bad_input_exits_2_with_the_rule(tmp_path, capsys):
    from hf_dist.cli import main

    assert main(["config", "--strategy", "zero3", "--gpus", "8", "--micro-batch", "1", "--global-batch", "60",
                 "--out", str(tmp_path)]) == 2
    assert "use global_batch_size in [56, 64]" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": "auto", "zero_optimisation": {"stage": 2}}))
    assert main(["config", "--check", str(bad)]) == 2
    assert "did you mean 'zero_optimization'" in capsys.readouterr().err


def test_layout_dir_precision_must_agree_with_the_deepspeed_json(tmp_path):
    write_layout_configs(tmp_path, strategy="zero2", num_gpus=2, micro_batch_size=1, gradient_accumulation_steps=1,
                         mixed_precision="fp16")
    assert read_layout_dir(tmp_path).mixed_precision == "fp16"
    ds = json.loads((tmp_path / "deepspeed.json").read_text())
    ds["bf16"] = {"enabled": True}
    (tmp_path / "deepspeed.json").write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=r"bf16.enabled=True disagrees with hf_dist.yaml \(which implies False\)"):
        read_layout_dir(tmp_path)

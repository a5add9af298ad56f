"""DistTrainingArguments and the contract it resolves; launch_env's backend decisions.

Pure: no process group. TrainingArguments starts one when WORLD_SIZE > 1, so multi-process worlds are tested
through ``resolve_contract`` and ``launch_env.prepare_environment`` directly.
"""

import os
from types import SimpleNamespace

import pytest
from transformers import HfArgumentParser

from hf_dist import DistTrainingArguments
from hf_dist.trainer import launch_env
from hf_dist.trainer.args import resolve_contract


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_")) or key == "WORLD_SIZE":
            monkeypatch.delenv(key)


def _launch_args(**kw):
    values = dict(deepspeed=None, fsdp=None, fsdp_config=None, use_cpu=False, ddp_backend=None)
    values.update(kw)
    return SimpleNamespace(**values)


def test_harbor_arguments_parse_and_resolve(tmp_path):
    (args,) = HfArgumentParser(DistTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--per_device_train_batch_size", "1", "--global_batch_size", "4",
              "--base_learning_rate", "2e-5", "--base_batch_size", "2", "--lr_scaling", "linear", "--tp_size", "1"]
    )
    assert args.gradient_accumulation_steps == 4
    assert args.learning_rate == pytest.approx(4e-5)


def test_harbor_contract_on_eight_ranks():
    c = resolve_contract(world_size=8, micro_batch_size=1, global_batch_size=64,
                         base_learning_rate=2e-5, base_batch_size=32)
    assert (c.dp, c.gradient_accumulation_steps, c.learning_rate) == (8, 8, pytest.approx(4e-5))


def test_tp_pp_shrink_the_data_parallel_size():
    c = resolve_contract(world_size=8, micro_batch_size=1, global_batch_size=16, tp_size=2, pp_size=2)
    assert c.dp == 2 and c.gradient_accumulation_steps == 8


def test_indivisible_global_batch_is_a_value_error():
    with pytest.raises(ValueError, match="global_batch_size=60"):
        resolve_contract(world_size=8, micro_batch_size=1, global_batch_size=60)


def test_explicit_accumulation_that_contradicts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 contradicts"):
        DistTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, global_batch_size=8,
                              gradient_accumulation_steps=3)


def test_without_global_batch_it_behaves_like_training_arguments(tmp_path):
    args = DistTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=3, learning_rate=1e-4)
    assert args.batch_contract.global_batch_size == 12 and args.learning_rate == 1e-4


def test_tp_that_does_not_divide_the_world(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="tp_size=4 does not divide the 6 processes per node"):
        DistTrainingArguments(output_dir=str(tmp_path), tp_size=4)


def test_cpu_multi_process_gets_use_cpu(monkeypatch):
    monkeypatch.setattr(launch_env, "has_gpu", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = _launch_args()
    launch_env.prepare_environment(args)
    assert args.use_cpu is True  # without it every rank would train alone


def test_deepspeed_launch_never_gets_use_cpu(monkeypatch):
    monkeypatch.setattr(launch_env, "has_gpu", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = _launch_args()
    launch_env.prepare_environment(args)
    assert args.use_cpu is False  # use_cpu would silently switch DeepSpeed off
    assert args.ddp_backend == "gloo"  # else accelerate sees 1 process and does not shard the data


def test_accelerate_fsdp2_request_is_taken_over(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer")
    args = _launch_args()
    launch_env.prepare_environment(args)
    request = launch_env.FsdpRequest.from_fields(args)
    assert request.reshard_after_forward is False
    assert request.wrap_classes == ("LlamaDecoderLayer",)
    assert os.environ["ACCELERATE_USE_FSDP"] == "true" and os.environ["FSDP_VERSION"] == "2"  # read, not deleted
    assert not args.fsdp


def test_fsdp1_without_gpu_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(launch_env, "has_gpu", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        launch_env.prepare_environment(_launch_args())


def test_fsdp_and_deepspeed_together_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="both DeepSpeed and FSDP"):
        launch_env.prepare_environment(_launch_args(deepspeed="ds.json", fsdp="full_shard",
                                                    fsdp_config={"version": 2}))


def test_training_arguments_fsdp_is_read(tmp_path):
    args = DistTrainingArguments(output_dir=str(tmp_path), fsdp="shard_grad_op", fsdp_config={"version": 2})
    assert args.hf_dist_fsdp is not None and args.hf_dist_fsdp.reshard_after_forward is False
    assert not args.fsdp  # the Trainer's own FSDP plugin stays off: hf_dist shards


def test_hybrid_shard_replicas_come_from_the_accelerate_parallelism_config(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    args = _launch_args()
    launch_env.prepare_environment(args)
    assert args.fsdp2_dp_replicate == 2
    assert os.environ["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"  # left for any other reader


def test_accelerate_tp_size_must_match_tp_size(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match="--tp_size 2"):
        launch_env.prepare_environment(_launch_args(tp_size=1))


def test_deepspeed_argument_on_cpu_with_several_processes_names_the_launch_fix(monkeypatch):
    monkeypatch.setattr(launch_env, "has_gpu", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="accelerate launch --config_file accelerate_configs/zero2.yaml"):
        launch_env.prepare_environment(_launch_args(deepspeed="ds_configs/zero2.json"))

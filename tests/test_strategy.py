"""One strategy model: what the planner may choose, ``hf-dist config`` writes and ``DistTrainingArguments`` accepts.

Pure (no process group): the launcher's environment comes from accelerate's own launch code on the written
YAML; ``TrainingArguments`` is kept from starting a process group, and the machine is taken to have the GPUs
the configs are written for (bf16 available, ``launch_env.has_gpu``).
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
from pathlib import Path
from unittest import mock

import pytest
import torch
from dist_utils import launcher_env
from transformers import HfArgumentParser, TrainingArguments

from hf_dist.cli import main as cli_main
from hf_dist.planner import PlanRequest, choose_layout, gpu_spec, model_spec
from hf_dist.planner.catalogue import ModelSpec
from hf_dist.strategy import OFFLOADS, STRATEGIES, Layout, strategy_dims
from hf_dist.trainer import launch_env
from hf_dist.trainer.args import DistTrainingArguments
from hf_dist.trainer.layout import layout_dims

MQA = ModelSpec(name="mqa", model_type="llama", hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=1, intermediate_size=688, vocab_size=1000)
REQUESTS = [  # (model, GPUs per node, nodes): GQA, MHA, MQA, one and two nodes
    (model_spec("llama-3-8b"), 8, 1), (model_spec("llama-2-13b"), 8, 2), (model_spec("qwen2.5-1.5b"), 4, 1),
    (MQA, 8, 1), (model_spec("llama-2-70b"), 8, 2),
]


def _no_process_group(self):
    self._n_gpu = 0
    return torch.device("cpu")


@pytest.fixture
def gpu_node(monkeypatch):
    """Arguments parsed as on the GPU node the configs are for, without starting a process group."""
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")) or key == "WORLD_SIZE":
            monkeypatch.delenv(key)
    monkeypatch.setattr(launch_env, "has_gpu", lambda: True)
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(TrainingArguments, "_setup_devices", property(_no_process_group))


def _planner_layouts() -> list[Layout]:
    """Every layout the planner evaluated (passed its rules) for the requests above, LoRA left aside."""
    seen: dict[Layout, None] = {}
    for model, gpus, nodes in REQUESTS:
        plan = choose_layout(PlanRequest(model=model, gpu=gpu_spec("a100-80gb"), num_gpus=gpus, num_nodes=nodes,
                                         seq_len=2048, global_batch=256))
        seen |= {c.layout: None for c in plan.candidates if c.memory is not None}
    return list(seen)


def _trainer_view(layout: Layout, folder: Path) -> DistTrainingArguments:
    """The ``DistTrainingArguments`` each process of ``launch.sh`` builds: launcher env + its training arguments."""
    _, env = launcher_env(folder / "accelerate.yaml")
    launch = (folder / "launch.sh").read_text()
    train_args = shlex.split(launch.split('"$SCRIPT"')[1].split('"$@"')[0])
    with mock.patch.dict(os.environ, {**env, "WORLD_SIZE": str(layout.world_size)}):
        (args,) = HfArgumentParser(DistTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(folder / "run"), *train_args])
        assert launch_env.deepspeed_requested(args) == ("ACCELERATE_DEEPSPEED_CONFIG_FILE" in env)
    if "ACCELERATE_DEEPSPEED_CONFIG_FILE" in env:  # the stage and offload DeepSpeed will read
        zero = json.loads(Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())["zero_optimization"]
        args.zero_stage = zero["stage"]
        args.zero_offload = (zero.get("offload_optimizer", {}).get("device", "none"),
                             zero.get("offload_param", {}).get("device", "none"))
    else:
        args.zero_stage = 0
    return args


def test_every_layout_the_planner_can_choose_is_written_and_accepted_as_it_was_planned(gpu_node, tmp_path):
    layouts = _planner_layouts()
    names = {x.name for x in layouts}
    # the tiers reach every kind: TP with sequence parallel, PP with TP, both offload flavours, hybrid, MQA + TP
    assert {"fsdp_full_shard+tp8sp", "fsdp_full_shard+tp8+pp2", "zero3+offload_cpu_optimizer",
            "fsdp_full_shard+offload_cpu", "fsdp_hybrid_shard", "zero3+offload_nvme"} <= names
    assert any(x.tp == 8 and x.num_gpus == 8 and x.world_size == 8 for x in layouts)  # MQA (1 KV head) at tp=8
    for i, layout in enumerate(layouts):
        folder = tmp_path / str(i)
        argv = ["config", "--strategy", layout.strategy, "--gpus", str(layout.num_gpus), "--nodes",
                str(layout.num_nodes), "--tp", str(layout.tp), "--pp", str(layout.pp), "--offload", layout.offload,
                "--micro-batch", "1", "--global-batch", str(2 * layout.dp), "--model", "llama", "--out", str(folder)]
        argv += ["--tp-sequence-parallel"] * layout.sequence_parallel + ["--tp-vocab-parallel"] * layout.vocab_parallel
        assert cli_main(argv) == 0, layout.name
        args = _trainer_view(layout, folder)
        fsdp = args.hf_dist_fsdp
        assert (args.tp_size, args.pp_size, args.tp_sequence_parallel, args.tp_vocab_parallel) == (
            layout.tp, layout.pp, layout.sequence_parallel, layout.vocab_parallel), layout.name
        assert (fsdp is not None) == layout.is_fsdp and (args.zero_stage > 0) == layout.is_deepspeed, layout.name
        if layout.is_fsdp:
            assert fsdp.reshard_after_forward == (layout.strategy != "fsdp_shard_grad_op")
            assert fsdp.cpu_offload == (layout.offload == "cpu")
            dims = layout_dims(world_size=layout.world_size, tp=args.tp_size, pp=args.pp_size, fsdp=True,
                               dp_replicate=fsdp.dp_replicate)
        else:
            dims = layout_dims(world_size=layout.world_size, tp=args.tp_size, pp=args.pp_size, fsdp=False)
        if layout.is_deepspeed:
            assert args.zero_stage == int(layout.strategy[-1])
            expected = {"none": ("none", "none"), "cpu_optimizer": ("cpu", "none"),
                        "cpu": ("cpu", "cpu" if layout.strategy == "zero3" else "none"), "nvme": ("nvme", "nvme")}
            assert args.zero_offload == expected[layout.offload], layout.name
        else:  # the trainer's mesh is the planner's mesh
            assert dims == layout.dims, layout.name
        assert args.batch_contract.dp == layout.dp and args.batch_contract.gradient_accumulation_steps == 2
        if layout.pp > 1:  # accumulation becomes pipeline micro-batches
            assert args.pp_microbatches == 2


def _fields_grid():
    for strategy, offload, tp, pp, nodes, sp in itertools.product(STRATEGIES, OFFLOADS, (1, 2, 3), (1, 2), (1, 2),
                                                                 (False, True)):
        yield dict(strategy=strategy, offload=offload, tp=tp, pp=pp, num_nodes=nodes, num_gpus=4,
                   sequence_parallel=sp)


def _refused(fields: dict) -> str | None:
    try:
        Layout(**fields)
    except ValueError as err:
        return str(err)
    return None


def test_what_the_strategy_model_refuses_config_refuses_and_the_planner_never_offers(tmp_path, capsys):
    planned = {(x.strategy, x.offload, x.tp, x.pp, x.num_nodes, x.sequence_parallel) for x in _planner_layouts()}
    refused = 0
    for i, fields in enumerate(_fields_grid()):
        why = _refused(fields)
        argv = ["config", "--strategy", fields["strategy"], "--gpus", "4", "--nodes", str(fields["num_nodes"]),
                "--tp", str(fields["tp"]), "--pp", str(fields["pp"]), "--offload", fields["offload"],
                "--micro-batch", "1", "--global-batch", "64", "--wrap", "LlamaDecoderLayer", "--out",
                str(tmp_path / str(i))]
        argv += ["--tp-sequence-parallel"] * fields["sequence_parallel"]
        code = cli_main(argv)
        err = capsys.readouterr().err
        if why is None:
            assert code == 0, (fields, err)
            continue
        refused += 1
        assert code == 2 and why in err, fields  # the same rule, the same words
        key = (fields["strategy"], fields["offload"], fields["tp"], fields["pp"], fields["num_nodes"],
               fields["sequence_parallel"])
        assert key not in planned
    assert refused > 100  # the grid reaches the rules


@pytest.mark.parametrize("fields", [
    dict(strategy="fsdp_full_shard", tp=2, pp=2, sequence_parallel=True),
    dict(strategy="ddp", tp=1, pp=1, sequence_parallel=True),
    dict(strategy="fsdp_full_shard", tp=1, pp=2, vocab_parallel=True),
])
def test_what_the_training_arguments_refuse_the_strategy_model_refuses(gpu_node, monkeypatch, fields, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError) as trainer_error:
        DistTrainingArguments(output_dir=str(tmp_path), tp_size=fields["tp"], pp_size=fields["pp"],
                              tp_sequence_parallel=fields.get("sequence_parallel", False),
                              tp_vocab_parallel=fields.get("vocab_parallel", False))
    with pytest.raises(ValueError) as model_error:
        Layout(num_gpus=8, **fields)
    # one rule (check_tp_options), spelled as each user knows the names
    spelled = str(model_error.value).replace("sequence_parallel", "tp_sequence_parallel").replace(
        "vocab_parallel", "tp_vocab_parallel").replace("tp >", "tp_size >").replace("with pp=", "with pp_size=")
    assert str(trainer_error.value) == spelled.replace("set tp or", "set tp_size or")


def test_one_mapping_to_parallel_dims():
    assert strategy_dims("ddp", world_size=8, tp=2) == Layout(strategy="ddp", num_gpus=8, tp=2).dims
    hybrid = Layout(strategy="fsdp_hybrid_shard", num_gpus=4, num_nodes=2).dims
    assert (hybrid.dp_replicate, hybrid.dp_shard) == (2, 4)
    assert layout_dims(world_size=8, tp=1, pp=1, fsdp=True, dp_replicate=2) == hybrid
    zero = Layout(strategy="zero3", num_gpus=8).dims
    assert (zero.dp_replicate, zero.dp_shard) == (1, 8)

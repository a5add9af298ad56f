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
from hf_dist.strategy import OFFLOADS, STRATEGIES, Layout
from hf_dist.trainer import launch_env
from hf_dist.trainer.args import DistTrainingArguments

MQA = ModelSpec(name="mqa", model_type="llama", hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=1, intermediate_size=688, vocab_size=1000)
REQUESTS = [  # (model, GPUs per node, nodes): GQA, MHA, MQA, one and two nodes
    (model_spec("llama-3-8b"), 8, 1), (model_spec("llama-2-13b"), 8, 2), (model_spec("qwen2.5-1.5b"), 4, 1),
    (MQA, 8, 1), (model_spec("llama-2-70b"), 8, 2), (model_spec("qwen3-30b-a3b"), 8, 1),  # a MoE: EP layouts
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
    world = {"WORLD_SIZE": str(layout.world_size), "LOCAL_WORLD_SIZE": str(layout.num_gpus)}
    with mock.patch.dict(os.environ, {**env, **world}):
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
    assert {"ddp+ep8", "fsdp_full_shard+ep8", "fsdp_full_shard+ep2"} <= names  # the MoE request's EP layouts
    for i, layout in enumerate(layouts):
        folder = tmp_path / str(i)
        argv = ["config", "--strategy", layout.strategy, "--gpus", str(layout.num_gpus), "--nodes",
                str(layout.num_nodes), "--tp", str(layout.tp), "--pp", str(layout.pp), "--cp", str(layout.cp),
                "--offload", layout.offload, "--ep", str(layout.ep), "--micro-batch", "1",
                "--global-batch", str(2 * layout.pp * layout.dp),
                "--model", "qwen3_moe" if layout.ep > 1 else "llama", "--out", str(folder)]
        argv += ["--tp-sequence-parallel"] * layout.sequence_parallel + ["--tp-vocab-parallel"] * layout.vocab_parallel
        assert cli_main(argv) == 0, layout.name
        args = _trainer_view(layout, folder)
        resolved = args.layout  # the run's one Layout, from the written YAML, DeepSpeed JSON and launch flags
        assert (resolved.strategy, resolved.num_gpus, resolved.num_nodes, resolved.tp, resolved.pp, resolved.cp,
                resolved.ep, resolved.offload, resolved.sequence_parallel, resolved.vocab_parallel,
                resolved.replicas) == (
            layout.strategy, layout.num_gpus, layout.num_nodes, layout.tp, layout.pp, layout.cp, layout.ep,
            layout.offload,
            layout.sequence_parallel, layout.vocab_parallel, layout.replicas), layout.name
        assert resolved.efsdp == layout.efsdp, layout.name
        assert resolved.dims == layout.dims and resolved.name == layout.name, layout.name
        fsdp = args.hf_dist_fsdp
        assert (fsdp is not None) == layout.is_fsdp and (args.zero_stage > 0) == layout.is_deepspeed, layout.name
        if layout.is_fsdp:
            assert fsdp.reshard_after_forward == (layout.strategy != "fsdp_shard_grad_op")
            assert fsdp.cpu_offload == (layout.offload == "cpu")
        if layout.is_deepspeed:  # what DeepSpeed itself will read agrees with the resolved layout
            assert args.zero_stage == int(layout.strategy[-1])
            expected = {"none": ("none", "none"), "cpu_optimizer": ("cpu", "none"),
                        "cpu": ("cpu", "cpu" if layout.strategy == "zero3" else "none"), "nvme": ("nvme", "nvme")}
            assert args.zero_offload == expected[layout.offload], layout.name
        accumulation = 2 * layout.pp  # at least one micro-batch per stage (1F1B)
        assert args.batch_contract.dp == layout.dp and args.batch_contract.gradient_accumulation_steps == accumulation
        if layout.pp > 1:  # accumulation becomes pipeline micro-batches
            assert args.pp_microbatches == accumulation


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


_REFUSED = [  # (Layout fields, the same request as training arguments)
    (dict(strategy="fsdp_full_shard", tp=2, pp=2, sequence_parallel=True),
     dict(fsdp2=True, tp_size=2, pp_size=2, tp_sequence_parallel=True)),
    (dict(strategy="ddp", sequence_parallel=True), dict(tp_sequence_parallel=True)),
    (dict(strategy="fsdp_full_shard", pp=2, vocab_parallel=True), dict(fsdp2=True, pp_size=2, tp_vocab_parallel=True)),
    (dict(strategy="fsdp_hybrid_shard", tp=2, dp_replicate=2), dict(fsdp2=True, fsdp2_dp_replicate=2, tp_size=2)),
    (dict(strategy="fsdp_hybrid_shard", pp=2, dp_replicate=2), dict(fsdp2=True, fsdp2_dp_replicate=2, pp_size=2)),
    (dict(strategy="fsdp_hybrid_shard", dp_replicate=2, dp_shard=2),
     dict(fsdp2=True, fsdp2_dp_replicate=2, fsdp2_dp_shard=2)),
    (dict(strategy="fsdp_hybrid_shard", dp_replicate=3), dict(fsdp2=True, fsdp2_dp_replicate=3)),
    (dict(strategy="fsdp_full_shard", pp=2, offload="cpu"), dict(fsdp2=True, fsdp2_cpu_offload=True, pp_size=2)),
    (dict(strategy="zero3", tp=2), dict(deepspeed={"zero_optimization": {"stage": 3}}, tp_size=2)),
    (dict(strategy="zero2", pp=2), dict(deepspeed={"zero_optimization": {"stage": 2}}, pp_size=2)),
    (dict(strategy="ddp", tp=3), dict(tp_size=3)),
    (dict(strategy="zero3", ep=2), dict(deepspeed={"zero_optimization": {"stage": 3}}, ep_size=2)),
    (dict(strategy="fsdp_shard_grad_op", ep=2, pp=2),
     dict(fsdp2=True, fsdp2_reshard_after_forward=False, ep_size=2, pp_size=2)),
    (dict(strategy="ddp", ep=2, tp=2, vocab_parallel=True), dict(ep_size=2, tp_size=2, tp_vocab_parallel=True)),
    (dict(strategy="fsdp_hybrid_shard", ep=8, dp_replicate=2), dict(fsdp2=True, fsdp2_dp_replicate=2, ep_size=8)),
    (dict(strategy="fsdp_full_shard", ep=2, offload="cpu"), dict(fsdp2=True, fsdp2_cpu_offload=True, ep_size=2)),
    (dict(strategy="fsdp_full_shard", ep=3), dict(fsdp2=True, ep_size=3)),
]


@pytest.mark.parametrize(("fields", "arguments"), _REFUSED)
def test_what_the_training_arguments_refuse_the_strategy_model_refuses(gpu_node, monkeypatch, fields, arguments,
                                                                       tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError) as trainer_error:
        DistTrainingArguments(output_dir=str(tmp_path), **arguments)
    with pytest.raises(ValueError) as model_error:
        Layout(num_gpus=8, **fields)
    assert str(trainer_error.value) == str(model_error.value)  # one rule, raised from one place


def test_an_ep_layout_is_written_and_accepted_as_it_was_asked(gpu_node, tmp_path):
    for strategy in ("fsdp_full_shard", "ddp"):
        layout = Layout(strategy=strategy, num_gpus=8, ep=4)
        folder = tmp_path / strategy
        argv = ["config", "--strategy", strategy, "--gpus", "8", "--ep", "4", "--micro-batch", "1",
                "--global-batch", "16", "--model", "qwen3_moe", "--out", str(folder)]
        assert cli_main(argv) == 0
        assert "--ep_size 4" in (folder / "launch.sh").read_text()
        resolved = _trainer_view(layout, folder).layout
        assert resolved == layout and resolved.dims == layout.dims and resolved.efsdp == 2


def test_one_mapping_to_parallel_dims(gpu_node, monkeypatch, tmp_path):
    ddp = Layout(strategy="ddp", num_gpus=8, tp=2).dims
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.tp) == (4, 1, 2)
    hybrid = Layout(strategy="fsdp_hybrid_shard", num_gpus=4, num_nodes=2).dims
    assert (hybrid.dp_replicate, hybrid.dp_shard) == (2, 4)
    zero = Layout(strategy="zero3", num_gpus=8).dims
    assert (zero.dp_replicate, zero.dp_shard) == (1, 8)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    args = DistTrainingArguments(output_dir=str(tmp_path), fsdp2=True, fsdp2_dp_replicate=2)
    assert args.layout.strategy == "fsdp_hybrid_shard" and args.layout.dims == hybrid
    (args,) = HfArgumentParser(DistTrainingArguments).parse_args_into_dataclasses(  # as a launch config states it
        ["--output_dir", str(tmp_path), "--fsdp2", "--fsdp2_dp_replicate", "2", "--fsdp2_dp_shard", "4"])
    assert args.hf_dist_fsdp.dp_shard == 4 and args.layout.dims == hybrid
    args = DistTrainingArguments(output_dir=str(tmp_path), tp_size=2)
    assert args.layout == Layout(strategy="ddp", num_gpus=4, num_nodes=2, tp=2)


def _answer(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "runs"


@pytest.mark.parametrize("world", [6, 8])
def test_the_ep_size_rule_is_one_answer_for_the_planner_the_run_and_the_mesh(gpu_node, monkeypatch, tmp_path, world):
    """"ep divides the ranks experts spread over" is stated once (``parallel_dims.valid_ep_sizes``): the planner's
    ``Layout``, the training arguments and a ``ParallelDims`` built directly accept and refuse the same sizes, and
    the planner and the run with the same words."""
    from hf_dist.parallel_dims import ParallelDims
    from hf_dist.planner.workload import make_layout

    monkeypatch.setenv("WORLD_SIZE", str(world))
    for ep in range(1, world + 2):
        for strategy, arguments in (("ddp", {}), ("fsdp_full_shard", {"fsdp2": True})):
            planner = _answer(lambda: make_layout(strategy, world, ep=ep))
            run = _answer(lambda: DistTrainingArguments(output_dir=str(tmp_path), ep_size=ep, **arguments))
            mesh = _answer(lambda: ParallelDims(world_size=world, dp_shard=-1, ep=ep))
            assert planner == run, (strategy, ep)
            assert (planner == "runs") == (mesh == "runs") == (world % ep == 0), (strategy, ep, mesh)


def test_deepspeed_with_fsdp_and_hsdp_without_resharding_are_refused_by_layout_for_every_reader(gpu_node, monkeypatch,
                                                                                               tmp_path):
    """The launch-config readers and ``resolve_layout`` ask ``Layout``'s rule; none words it again."""
    with pytest.raises(ValueError) as rule:
        Layout.check_one_engine(deepspeed=True, fsdp=True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError) as run:
        DistTrainingArguments(output_dir=str(tmp_path), deepspeed=str(config), fsdp2=True)
    assert str(run.value) == str(rule.value)
    with pytest.raises(ValueError) as rule:
        Layout.fsdp_strategy(dp_replicate=2, reshard_after_forward=False)
    with pytest.raises(ValueError) as run:
        DistTrainingArguments(output_dir=str(tmp_path), fsdp2=True, fsdp2_dp_replicate=2,
                              fsdp2_reshard_after_forward=False)
    assert str(run.value) == str(rule.value)
    assert Layout.fsdp_strategy(dp_replicate=1, reshard_after_forward=False) == "fsdp_shard_grad_op"


def test_config_with_a_model_refuses_what_the_run_refuses_for_it(tmp_path, capsys):
    """``hf-dist config --model`` asks ``hf_dist.support.model_refusals`` (the run's own answer) before writing."""
    from transformers import AutoConfig

    from hf_dist.support import model_refusals

    layout = Layout(strategy="fsdp_full_shard", num_gpus=8, ep=4)
    reasons = model_refusals(AutoConfig.for_model("qwen2"), layout)  # a dense model: EP has no experts to split
    assert reasons
    argv = ["config", "--strategy", "fsdp_full_shard", "--gpus", "8", "--ep", "4", "--micro-batch", "1",
            "--global-batch", "16", "--model", "qwen2", "--out", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert reasons[0] in capsys.readouterr().err and not (tmp_path / "out").exists()

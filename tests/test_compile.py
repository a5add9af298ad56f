"""``torch.compile`` per block inside ``hf_dist.parallelize`` (``--torch_compile``): equal to eager on 2 gloo ranks.

One process group runs DDP, FSDP2, TP=2 and PP=2 with ``torch_compile=True`` (inductor; the chunked loss on where
it applies) for 3 AdamW steps each, against one eager process with the model's own loss. Compiling costs about a
minute on a cold inductor cache, so the layouts share one group and one test.
"""

import tempfile

import pytest
import torch

from dist_utils import run_distributed
from trainer_harness import train_tiny

from hf_dist.compile import CompileRequest, CompileStats, compile_blocks, is_block_compiled

STEPS = 3
LAYOUTS = {
    "ddp": {},
    "fsdp2": {"fsdp": "full_shard", "fsdp_config": {"version": 2}},
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "per_device_train_batch_size": 4},
}


def _run(**overrides):
    overrides = {"per_device_train_batch_size": 2, **overrides}
    with tempfile.TemporaryDirectory() as out:
        losses, params, trainer = train_tiny(out, max_steps=STEPS, global_batch_size=8, **overrides)
    model = trainer.accelerator.unwrap_model(trainer.model)
    compiled = sum(is_block_compiled(m) for m in model.modules())
    return {"losses": losses, "params": params, "compiled": compiled, "stats": CompileStats.now(),
            "wrapped": type(trainer.model_wrapped).__name__}


def _group(rank, world_size):
    return {name: _run(torch_compile=True, **overrides) for name, overrides in LAYOUTS.items()}


def test_compiled_layouts_equal_one_eager_process():
    ref = _run(per_device_train_batch_size=4, chunked_loss=False)
    assert ref["compiled"] == 0
    seen = {name: set() for name in LAYOUTS}
    for rank_runs in run_distributed(_group, 2, timeout_s=1200):
        for name, run in rank_runs.items():
            expected_blocks = 1 if name == "pp2" else 2  # a stage holds one of the two layers
            assert run["compiled"] == expected_blocks, name
            assert run["wrapped"] != "OptimizedModule", name  # accelerate did not compile the whole model too
            assert run["stats"].graph_breaks == 0, name
            torch.testing.assert_close(run["losses"], ref["losses"], rtol=0, atol=1e-5, msg=name)
            for key, value in run["params"].items():  # under PP, this rank's stage
                torch.testing.assert_close(value, ref["params"][key], rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
            seen[name] |= run["params"].keys()
    for name, keys in seen.items():
        assert keys == ref["params"].keys(), name


def test_compile_blocks_keeps_parameter_names_and_counts_graphs():
    from hf_dist.models import build_tiny_model

    model = build_tiny_model(vocab_size=64, hidden_size=32, num_hidden_layers=2)
    names = [n for n, _ in model.named_parameters()]
    before = CompileStats.now().graphs
    compile_blocks(list(model.model.layers), CompileRequest(backend="eager"))
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and FSDP see the same FQNs
    model(input_ids=torch.randint(0, 64, (1, 8)))
    assert CompileStats.now().graphs - before == 2  # one graph per block, no graph break
    assert CompileStats.now().graph_breaks == 0


@pytest.mark.parametrize("flag", [False, True])
def test_request_from_training_arguments(flag):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", torch_compile=flag, use_cpu=True)
    request = CompileRequest.from_args(args)
    assert (request is not None) == flag
    if flag:
        assert request.backend == "inductor"

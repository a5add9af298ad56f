"""``torch.compile`` per block inside ``hf_dist.parallelize`` (``--torch_compile``): equal to eager on 2 gloo ranks.

One process group runs DDP, FSDP2, TP=2 and PP=2 with ``torch_compile=True`` (inductor; the chunked loss on where
it applies) for 3 plain SGD steps each, against one eager process with the model's own loss, through the parity
harness: the TP sweep's non-default Llama (``parity.tiny_config``, loaded from disk), ``trainer_harness.trainer_run``
(under PP ``train_tiny``: a rank holds its stage's gradients only) and ``parity.assert_parity`` (losses within 1e-5,
the first optimizer step's gradients and every parameter after the last step within 1e-5 + 1e-5 relative). SGD:
parameters after it compare gradients; 3 AdamW steps at lr 1e-3 moved one of 2,048 ``o_proj`` weights 1.5e-5 apart
under DDP (the first step's gradients within 1e-5), the optimizer amplifying the compiled kernels' rounding where a
gradient is near zero. Compiling costs about a minute on a cold inductor cache, so the layouts share one group and
one test.
"""

import tempfile

import pytest
import torch

from dist_utils import run_distributed
from parity import assert_parity, tiny_config, tiny_model
from trainer_harness import train_tiny, trainer_run

from hf_dist.compile import CompileRequest, CompileStats, compile_blocks, is_block_compiled

STEPS = 3
SGD = dict(optim="sgd", learning_rate=1e-2)
LAYOUTS = {
    "ddp": {},
    "fsdp2": {"fsdp": "full_shard", "fsdp_config": {"version": 2}},
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "per_device_train_batch_size": 4},
}


def _run(**overrides):
    """A run in ``assert_parity``'s shape (under PP losses and parameters only), and what compiling did."""
    overrides = {"per_device_train_batch_size": 2, "max_steps": STEPS, "global_batch_size": 8, **SGD,
                 "model": tiny_model(tiny_config("llama", "tp"), loaded=True), **overrides}
    with tempfile.TemporaryDirectory() as out:
        if overrides.get("pp_size", 1) > 1:
            losses, params, trainer = train_tiny(out, **overrides)
            run = {"losses": losses, "state": params}
        else:
            run, trainer = trainer_run(out, **overrides)
    model = trainer.accelerator.unwrap_model(trainer.model)
    compiled = sum(is_block_compiled(m) for m in model.modules())
    return {**run, "compiled": compiled, "stats": CompileStats.now(), "wrapped": type(trainer.model_wrapped).__name__}


def _group(rank, world_size):
    return {name: _run(torch_compile=True, **overrides) for name, overrides in LAYOUTS.items()}


def test_compiled_layouts_equal_one_eager_process():
    ref = _run(per_device_train_batch_size=4, chunked_loss=False)
    assert ref["compiled"] == 0
    for rank, rank_runs in enumerate(run_distributed(_group, 2, timeout_s=1200)):
        for name, run in rank_runs.items():
            expected_blocks = 1 if name == "pp2" else 2  # a stage holds one of the two layers
            assert run["compiled"] == expected_blocks, name
            assert run["wrapped"] != "OptimizedModule", name  # accelerate did not compile the whole model too
            assert run["stats"].graph_breaks == 0, name
            want = ref if "grads" in run else {k: ref[k] for k in ("losses", "state")}
            assert_parity(run, want, state_rtol=1e-5, what=f"rank {rank} {name} compiled vs eager")


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

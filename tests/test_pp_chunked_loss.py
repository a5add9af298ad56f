"""PP's last stage with the chunked loss (``hf_dist.loss``): equal to one process, and no whole logits in training.

One 2-rank group (pp=2, fp32, gloo) trains the harness's cases (``parity.tiny_config``, loaded from disk): an untied
Llama (1f1b), a tied Llama with both ends on rank 0 (zbv's V placement: one shared Parameter) and on two ranks (1f1b:
two copies, gradients summed), and a Gemma-2 whose logits are soft-capped at 0.5, each with the last stage's loss made
5 tokens at a time; losses, norms, first-step gradients and parameters after plain SGD steps equal the harness's
one-process reference within 1e-5 (``parity.assert_parity``). Then it probes the largest tensor the last stage's rank
makes in one training step, chunked against whole logits (``chunked_loss=False``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from parity import PP_SGD, assert_parity, masked_batches, pipelined_run, reference_run, tiny_config, tiny_model
from pp_sweep_cases import SEQ

ROWS, STEPS, CHUNK_TOKENS = 8, 3, 5
PROBE_VOCAB, PROBE_ROWS = 1024, 16  # a micro-batch's logits (8 x 32 x 1024) dwarf the head (1024 x 32)

CASES = {  # name: (case, schedule, micro-batches)
    "llama_1f1b": ("llama:gqa", "1f1b", 4),
    "tied_1f1b": ("llama:gqa_tied", "1f1b", 4),
    "tied_zbv": ("llama:gqa_tied", "zbv", 8),
    "gemma2_softcap": ("gemma2:softcap05", "1f1b", 4),
}


def _steps(case: str, rows: int = ROWS) -> list[dict[str, torch.Tensor]]:
    return masked_batches(tiny_config(case, "pp").vocab_size, SEQ, STEPS, rows=rows)


class _LargestTensor(TorchDispatchMode):
    """The largest tensor (elements) any op makes while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _pipe(model, schedule: str, microbatches: int, *, chunked: bool = True):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    config = PipelineConfig(schedule=schedule, microbatches=microbatches)
    pipe = PipelinedCausalLM(model, dims=dims, config=config, chunked_loss=chunked)
    for stage in pipe.modules:
        if stage.chunked_loss is not None:
            stage.chunked_loss.chunk_tokens = CHUNK_TOKENS  # many chunks per micro-batch
    return pipe


def _largest_in_step(chunked: bool) -> int | None:
    """The largest tensor the last stage's rank makes in its second training step (the first infers shapes)."""
    config = copy.deepcopy(tiny_config("llama:gqa", "pp"))
    config.vocab_size = PROBE_VOCAB
    pipe = _pipe(tiny_model(config), "1f1b", 2, chunked=chunked)
    batch = masked_batches(PROBE_VOCAB, SEQ, 2, rows=PROBE_ROWS)
    pipe.train_step(batch[0])
    if not pipe.has_last:
        pipe.train_step(batch[1])
        return None
    with _LargestTensor() as probe:
        pipe.train_step(batch[1])
    return probe.largest


def _two_ranks(rank, world_size):
    results = {}
    for name, (case, schedule, microbatches) in CASES.items():
        pipe = _pipe(tiny_model(tiny_config(case, "pp"), loaded=True), schedule, microbatches)
        last = [s for s in pipe.modules if s.is_last]
        chunked_on_last = None if not last else last[0].chunked_loss is not None
        run = pipelined_run(pipe, _steps(case), PP_SGD, grads=True)
        eval_logits = pipe.eval_step(_steps(case, rows=2)[0])[1]  # evaluation still gets whole logits
        results[name] = run | {
            "chunked_on_last": chunked_on_last, "eval_shape": None if eval_logits is None else eval_logits.shape,
        }
    results["largest"] = {"chunked": _largest_in_step(True), "whole": _largest_in_step(False)}
    return results


@pytest.fixture(scope="module")
def two_rank_run():
    return run_distributed(_two_ranks, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_pp_last_stage_chunked_loss_matches_one_process(two_rank_run, name):
    case = CASES[name][0]
    config = tiny_config(case, "pp")
    ref = reference_run(tiny_model(config, loaded=True), [[batch] for batch in _steps(case)], PP_SGD, grads=True)
    assert min(ref["norms"]) > PP_SGD.max_norm  # clipping active: the global norm across stages matters
    assert [r[name]["chunked_on_last"] for r in two_rank_run if r[name]["chunked_on_last"] is not None] == [True]
    grads = {n: g for r in two_rank_run for n, g in r[name]["grads"].items()}  # each stage's
    for rank in (0, 1):  # the last stage's loss and the global norm reach every rank
        got = two_rank_run[rank][name]
        run = {"losses": got["losses"], "norms": got["norms"], "grads": grads, "state": two_rank_run[0][name]["state"]}
        assert_parity(run, ref, config=config, what=f"{name}, rank {rank}")
    shapes = [r[name]["eval_shape"] for r in two_rank_run if r[name]["eval_shape"] is not None]
    assert shapes == [torch.Size([2, SEQ, config.vocab_size])]


def test_pp_last_stage_never_builds_whole_logits(two_rank_run):
    micro_logits = (PROBE_ROWS // 2) * SEQ * PROBE_VOCAB
    largest = next(r["largest"] for r in two_rank_run if r["largest"]["chunked"] is not None)
    assert largest["whole"] >= micro_logits  # the probe sees the whole logits of a micro-batch without chunking
    # chunked: a decoder layer's MLP activation is the largest (the sequences are padded to a multiple of 64)
    assert largest["chunked"] < largest["whole"] / 2

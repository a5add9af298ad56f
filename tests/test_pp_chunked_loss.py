"""PP's last stage with the chunked loss (``hf_dist.loss``): equal to one process, and no whole logits in training.

One 2-rank group (pp=2, fp32, gloo) trains an untied Llama (1f1b), a tied Llama with both ends on rank 0 (zbv's V
placement: one shared Parameter) and on two ranks (1f1b: two copies, gradients summed), and a Gemma-2 whose logits
are soft-capped, each with the last stage's loss made 5 tokens at a time; then it probes the largest tensor the
last stage's rank makes in one training step, chunked against whole logits (``chunked_loss=False``).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from pp_harness import HIDDEN, SEQ, VOCAB, batches, pipelined_run, portable, reference_run, tiny_model

GLOBAL_BATCH, CHUNK_TOKENS = 8, 5
PROBE_VOCAB, PROBE_BATCH = 1024, 16  # a micro-batch's logits (8 x 32 x 1024) dwarf the head (1024 x 64)


def _gemma2():
    from transformers import Gemma2Config

    from hf_dist.models.tiny import build_tiny_model

    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, final_logit_softcapping=0.5,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    return build_tiny_model(config, seed=0)


CASES = {  # name: (model builder, schedule, micro-batches)
    "llama_1f1b": (tiny_model, "1f1b", 4),
    "tied_1f1b": (lambda: tiny_model(tie_word_embeddings=True), "1f1b", 4),
    "tied_zbv": (lambda: tiny_model(tie_word_embeddings=True), "zbv", 8),
    "gemma2_softcap": (_gemma2, "1f1b", 4),
}


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
    pipe = _pipe(tiny_model(vocab_size=PROBE_VOCAB), "1f1b", 2, chunked=chunked)
    batch = batches(PROBE_BATCH, steps=2)
    pipe.train_step(batch[0])
    if not pipe.has_last:
        pipe.train_step(batch[1])
        return None
    with _LargestTensor() as probe:
        pipe.train_step(batch[1])
    return probe.largest


def _two_ranks(rank, world_size):
    from hf_dist.pipeline_parallel import gather_state_dict

    results = {}
    for name, (build, schedule, microbatches) in CASES.items():
        pipe = _pipe(build(), schedule, microbatches)
        last = [s for s in pipe.modules if s.is_last]
        chunked_on_last = None if not last else last[0].chunked_loss is not None
        losses, norms = pipelined_run(pipe, batches(GLOBAL_BATCH), dp_rank=0, dp=1)
        eval_logits = pipe.eval_step(batches(2, steps=1)[0])[1]  # evaluation still gets whole logits
        results[name] = {
            "losses": losses, "norms": norms, "state": portable(gather_state_dict(pipe)),
            "chunked_on_last": chunked_on_last, "eval_shape": None if eval_logits is None else eval_logits.shape,
        }
    results["largest"] = {"chunked": _largest_in_step(True), "whole": _largest_in_step(False)}
    return results


@pytest.fixture(scope="module")
def two_rank_run():
    return run_distributed(_two_ranks, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_pp_last_stage_chunked_loss_matches_one_process(two_rank_run, name):
    build, _, _ = CASES[name]
    ref_losses, ref_norms, ref_state = reference_run(build(), batches(GLOBAL_BATCH))
    assert [r[name]["chunked_on_last"] for r in two_rank_run if r[name]["chunked_on_last"] is not None] == [True]
    for rank in (0, 1):
        got = two_rank_run[rank][name]
        assert_close(got["losses"], ref_losses, atol=1e-5, rtol=0, msg=f"{name} loss, rank {rank}")
        assert_close(got["norms"], ref_norms, atol=1e-5, rtol=1e-5, msg=f"{name} grad norm, rank {rank}")
    state = two_rank_run[0][name]["state"]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        assert_close(torch.from_numpy(state[key]), value, atol=1e-5, rtol=0, msg=f"{name} {key}")
    shapes = [r[name]["eval_shape"] for r in two_rank_run if r[name]["eval_shape"] is not None]
    assert shapes == [torch.Size([2, SEQ, VOCAB])]


def test_pp_last_stage_never_builds_whole_logits(two_rank_run):
    micro_logits = (PROBE_BATCH // 2) * SEQ * PROBE_VOCAB
    largest = next(r["largest"] for r in two_rank_run if r["largest"]["chunked"] is not None)
    assert largest["whole"] >= micro_logits  # the probe sees the whole logits of a micro-batch without chunking
    # chunked: a decoder layer's MLP activation is the largest (the sequences are padded to a multiple of 64)
    assert largest["chunked"] < largest["whole"] / 2

"""Tensor parallelism through ``hf_dist.parallelize`` against one process, beside sequence, vocab and data parallelism.

Each case is a config case of the parity harness (``parity.tiny_config(case, "tp")``: ``tp_sweep_cases``' non-default
values, a sliding window of 8 tokens under 16-token rows where the type has one, heads x head_dim != hidden, tied heads
where the default is untied; its variants: an untied head, one KV head) with a layout: TP=2, optionally a user's plan,
sequence parallelism, vocab parallelism, and on 4 ranks FSDP2 or replicated dp=2 beside it. The model is loaded from
disk as users load theirs; the rows are fresh every step and padded to different lengths (``parity.masked_batches``).
Every case: the logits before training, and 5 plain SGD steps with clipping active, through the harness's one process
(``reference_run``) and the layout's run (``layout_run``), compared by ``assert_parity``: losses, gradient norms, the
first step's gradients and every parameter after the steps within 1e-5. One spawn per world size runs every case.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import spawn_once
from parity import TP_SGD, assert_parity, default_fields, layout_run, masked_batches, reference_run, slice_rows
from parity import tiny_config, tiny_model
from tp_sweep_cases import SEQ

STEPS = 5


def mlp_only_plan() -> dict:
    """A user's plan (``tp_plan=``): only the MLP split; built in the rank (styles are not sent between processes)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }


TP2_CASES = {
    "llama": {"case": "llama"},
    "mistral": {"case": "mistral"},
    "qwen2": {"case": "qwen2"},
    "qwen3": {"case": "qwen3"},
    "phi3": {"case": "phi3"},  # fused q/k/v and gate/up
    "gpt_neox": {"case": "gpt_neox"},
    "llama_user_plan": {"case": "llama", "plan": True},
    "llama_mqa_sp": {"case": "llama:mqa", "sp": True},  # the one KV head copied on each rank, beside sequence shards
    "qwen3_mqa": {"case": "qwen3:mqa"},
    "llama_untied_sp_vp": {"case": "llama:untied", "sp": True, "vp": True},
    "qwen3_sp": {"case": "qwen3", "sp": True},  # head norms whole beside the sequence-split norms
    "phi3_sp": {"case": "phi3", "sp": True},  # fused q/k/v and gate/up behind the sequence gather
    "qwen2_tied_vp": {"case": "qwen2", "vp": True},
}
DP_TP_CASES = {
    "llama_untied_fsdp_x_tp": {"case": "llama:untied", "dp": "fsdp"},
    "llama_replicate_x_tp": {"case": "llama", "dp": "replicate"},
    "phi3_tied_fsdp_x_tp_vp": {"case": "phi3", "dp": "fsdp", "vp": True},
    "qwen2_mqa_fsdp_x_tp": {"case": "qwen2:mqa", "dp": "fsdp"},
}
"""name -> config case (``tp_sweep_cases``), ``dp`` (4 ranks: dp=2 beside TP=2), ``sp``, ``vp``, ``plan``."""


def _model(case: str):
    return tiny_model(tiny_config(case, "tp"), loaded=True)


def _batches(case: str) -> list[dict[str, torch.Tensor]]:
    return masked_batches(tiny_config(case, "tp").vocab_size, SEQ, STEPS)


def gather_vocab(logits: torch.Tensor, tp_mesh) -> torch.Tensor:
    """Whole logits from vocab-sharded ones (test-only: this is what vocab parallelism avoids)."""
    parts = [torch.empty_like(logits) for _ in range(tp_mesh.size())]
    dist.all_gather(parts, logits.contiguous(), group=tp_mesh.get_group())
    return torch.cat(parts, dim=-1)


def run_case(layout: dict) -> dict:
    """One case on this rank: the layout's logits on the first batch (before training) and its ``layout_run``."""
    from hf_dist import ParallelDims, parallelize

    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, tp=2, dp_shard=world // 2)
    dims.build_mesh("cpu")
    model = parallelize(_model(layout["case"]), dims, fsdp=layout.get("dp") == "fsdp",
                        tp_plan=mlp_only_plan() if layout.get("plan") else None,
                        sequence_parallel=layout.get("sp", False), vocab_parallel=layout.get("vp", False))
    batches = _batches(layout["case"])
    dp_rank = dims.get_mesh("dp").get_local_rank() if dims.dp > 1 else 0
    with torch.no_grad():
        logits = model(**{k: v for k, v in slice_rows(batches[0], dp_rank, dims.dp).items() if k != "labels"}).logits
    if layout.get("vp"):
        logits = gather_vocab(logits, dims.get_mesh("tp"))
    run = layout_run(model, batches, TP_SGD, dp_rank=dp_rank, dp=dims.dp, grads=True,
                     dp_group=dims.get_mesh("dp").get_group() if dims.dp > 1 else None)
    return {"logits": logits, "dp_rank": dp_rank, "run": run}


def _run_cases(rank, world_size, cases):
    return {name: run_case(layout) for name, layout in cases.items()}


def results(world_size: int) -> list[dict]:
    """Per-rank results of the one spawn of ``world_size`` ranks (every case of that size), shared by the tests."""
    return spawn_once(f"tp_parity_{world_size}", _run_cases, world_size, TP2_CASES if world_size == 2 else DP_TP_CASES)


@functools.lru_cache(maxsize=None)
def reference(case: str) -> dict:
    """The harness's one process on each step's whole batch, and its logits on the first batch."""
    model = _model(case)
    batches = _batches(case)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batches[0].items() if k != "labels"}).logits
    return {"logits": logits, **reference_run(model, [[batch] for batch in batches], TP_SGD, grads=True)}


def check_case(per_rank: list[dict], name: str, layout: dict) -> None:
    ref = reference(layout["case"])
    assert min(ref["norms"]) > TP_SGD.max_norm  # clipping active: the norm over every mesh decides the update
    dp = len(per_rank) // 2
    for rank, by_case in enumerate(per_rank):
        result = by_case[name]
        want = ref["logits"].chunk(dp)[result["dp_rank"]]
        assert_close(result["logits"], want, atol=1e-5, rtol=0, msg=lambda m: f"rank {rank} {name} logits: {m}")
        assert_parity(result["run"], ref, config=tiny_config(layout["case"], "tp"), what=f"rank {rank} {name}")


@pytest.mark.parametrize("name", list(TP2_CASES))
def test_tp2_matches_single_process(name):
    check_case(results(2), name, TP2_CASES[name])


@pytest.mark.parametrize("name", list(DP_TP_CASES))
def test_dp2_x_tp2_matches_single_process(name):
    check_case(results(4), name, DP_TP_CASES[name])


def test_every_case_moves_the_fields_the_registry_names():
    """The registry's parity fields (a sliding window where the type has one) are off their defaults in every case."""
    for layout in (*TP2_CASES.values(), *DP_TP_CASES.values()):
        assert default_fields(tiny_config(layout["case"], "tp")) == [], layout["case"]

"""``hf_dist.data_parallel``: replicated dp reduces gradients in buckets, once per optimizer step.

Pure: how parameters are split into buckets. Two gloo ranks (one spawn), against one process:
- gradient accumulation 4 with ``no_sync`` on the first three micro steps: ``all_reduce`` is called exactly once
  per bucket per optimizer step (none on the deferred micro steps), each started during the backward as its
  gradients were ready, and the losses, first-step gradients and trained weights equal one process on the whole
  batch (the harness's ``reference_run`` and ``assert_parity``, ``tests/parity.py``); some parameters are TP
  DTensors (on a tp axis of size 1) sharing buckets with plain ones;
- accelerate's ``Accelerator.no_sync`` (what the HF Trainer calls on deferred micro steps) reaches the model's;
- a parameter unused on one rank gets the average (zeros from that rank); one unused everywhere keeps no gradient.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from dist_utils import run_distributed
from parity import Recipe, assert_parity, reference_run
from pp_harness import padded_batch, tiny_model

ACCUMULATION, MICRO, STEPS, CAP_MB = 4, 2, 2, 0.25
ADAMW = Recipe(lr=1e-3)  # AdamW, its default weight decay


def test_buckets_split_by_dtype_and_cap_in_the_given_order():
    from hf_dist.data_parallel import plan_buckets

    f32 = [nn.Parameter(torch.zeros(100)) for _ in range(5)]  # 400 bytes each
    bf16 = [nn.Parameter(torch.zeros(100, dtype=torch.bfloat16)) for _ in range(2)]  # 200 bytes each
    params = [f32[0], bf16[0], f32[1], f32[2], bf16[1], f32[3], f32[4]]
    buckets = plan_buckets(params, cap_bytes=800)
    groups = [[next(i for i, q in enumerate(params) if q is p) for p in b.params] for b in buckets]
    assert groups == [[0, 2], [3, 5], [1, 4], [6]]
    assert [b.dtype for b in buckets] == [torch.float32, torch.float32, torch.bfloat16, torch.float32]
    assert [b.numel for b in buckets] == [200, 200, 200, 100]
    assert [len(b.params) for b in plan_buckets(params, cap_bytes=1)] == [1] * 7  # larger than the cap: alone
    with pytest.raises(ValueError, match="must be positive"):
        plan_buckets(params, cap_bytes=0)


def test_a_bucket_size_that_is_not_positive_is_refused():
    from hf_dist.data_parallel import GradientReducer

    with pytest.raises(ValueError, match="bucket_cap_mb=0 must be positive"):
        GradientReducer(nn.Linear(2, 2), None, bucket_cap_mb=0)


def _micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """The whole step's batch: ``ACCUMULATION`` x 2 ranks micro batches of ``MICRO`` uniform-length rows."""
    ids = padded_batch(2 * ACCUMULATION * MICRO, 10 + step)["input_ids"]
    return [{"input_ids": rows, "labels": rows} for rows in ids.split(MICRO)]


def _reference() -> dict:
    """One process on the whole batch: the harness's reference (``parity.reference_run``), first-step gradients kept."""
    return reference_run(tiny_model(), [_micro_batches(step) for step in range(STEPS)], ADAMW, grads=True)


def _replicated_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hf_dist.data_parallel import replicate

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    model = tiny_model()
    plan = {"model.layers.0.mlp.up_proj": ColwiseParallel(), "model.layers.0.mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    return replicate(model, mesh["dp"], bucket_cap_mb=CAP_MB)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _accumulation_case(rank: int) -> dict:
    model = _replicated_model()
    optimizer = ADAMW.optimizer_for(model.parameters())
    calls, losses, overlapped, grads = [], [], [], None
    for step in range(STEPS):
        mine = _micro_batches(step)[rank * ACCUMULATION : (rank + 1) * ACCUMULATION]
        loss = torch.zeros(())
        for i, batch in enumerate(mine):
            sync = i == ACCUMULATION - 1
            with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as counted:
                with contextlib.nullcontext() if sync else model.no_sync():
                    micro = model(**batch).loss / ACCUMULATION  # equal-length rows: the token-weighted mean
                    micro.backward()
            loss += micro.detach()
            calls.append(counted.call_count)
        dist.all_reduce(loss)  # this rank's share of the step's loss, averaged over the 2 ranks
        losses.append(float(loss) / 2)
        if step == 0:
            grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
        overlapped.append(model.gradient_reducer.overlapped)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "calls": calls, "buckets": len(model.gradient_reducer.buckets), "overlapped": overlapped,
        "run": {"losses": losses, "grads": grads,
                "state": {n: _local(p).detach().clone() for n, p in model.state_dict().items()}},
        "dtensor_params": sum(hasattr(p, "full_tensor") for p in model.parameters()),
    }


def _accelerate_case() -> bool:
    from accelerate import Accelerator

    model = _replicated_model()
    with Accelerator(cpu=True).no_sync(model):
        deferred = not model.gradient_reducer.requires_sync
    return deferred and model.gradient_reducer.requires_sync


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.always, self.rank0_only, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.always(x)
        return self.rank0_only(out) if dist.get_rank() == 0 else out


def _unused_case(rank: int) -> tuple[dict, int]:
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dist.data_parallel import replicate

    model = replicate(_TwoBranches(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    model(torch.ones(3, 4)).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return grads, model.gradient_reducer.overlapped


def _two_ranks(rank: int, world_size: int) -> dict:
    return {"accumulation": _accumulation_case(rank), "accelerate": _accelerate_case(), "unused": _unused_case(rank)}


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_two_ranks, 2)


def test_one_all_reduce_per_bucket_per_optimizer_step_and_gradients_of_one_process(per_rank):
    reference = _reference()
    for rank, result in enumerate(r["accumulation"] for r in per_rank):
        buckets = result["buckets"]
        assert 1 < buckets < len(reference["grads"])  # several buckets, fewer than parameters
        assert result["dtensor_params"] == 2
        assert result["calls"] == [0] * (ACCUMULATION - 1) + [buckets] + [0] * (ACCUMULATION - 1) + [buckets]
        # every bucket started from the hooks as it filled, before the backward ended (the last one at its end)
        assert result["overlapped"] == [buckets] * STEPS
        # losses, the first step's gradients and every weight after the steps equal one process's
        assert_parity(result["run"], reference, atol=1e-5, state_atol=1e-5, what=f"rank {rank}")


def test_accelerate_no_sync_defers_the_reduction(per_rank):
    assert [r["accelerate"] for r in per_rank] == [True, True]


def test_unused_parameters_average_zeros_or_keep_no_gradient(per_rank):
    x = torch.ones(3, 4)
    torch.manual_seed(0)
    always, rank0_only, _ = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    rank0_only(always(x)).sum().backward()  # rank 0's loss; rank 1's is always(x).sum()
    always_grad_rank1 = torch.autograd.grad(always(x).sum(), always.weight)[0]
    for grads, overlapped in (r["unused"] for r in per_rank):
        assert overlapped == 0  # one bucket, never complete: started at the end of the backward
        assert grads["never.weight"] is None and grads["never.bias"] is None
        assert_close(grads["rank0_only.weight"], rank0_only.weight.grad / 2)
        assert_close(grads["always.weight"], (always.weight.grad + always_grad_rank1) / 2)

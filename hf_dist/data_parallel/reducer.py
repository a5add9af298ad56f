"""Data parallelism without FSDP: whole parameters (or TP shards) on every dp rank, gradients averaged over dp
in buckets, once per optimizer step.

``replicate(model, dp_mesh)`` broadcasts the parameters from dp rank 0 and attaches a ``GradientReducer``. In a
backward with gradient sync on, each parameter's post-accumulate-grad hook marks it ready; a bucket whose
gradients are all ready starts its ``all_reduce`` asynchronously (overlapping the rest of the backward), in
bucket order -- a bucket ready early waits for the ones before it, so every rank issues the same collectives in
the same order. At the end of the backward (an autograd engine callback) the buckets not yet started (some
gradient missing on this rank) start, all are waited for, divided by the dp size and written back.

Gradient accumulation: ``model.no_sync()`` (what accelerate's ``Accelerator.no_sync`` -- and so the HF Trainer --
calls on every micro step but the last) or ``model.set_requires_gradient_sync(False)`` (FSDP2's name) turns the
hooks off; gradients accumulate locally, and the last micro step's backward reduces their sum: one collective
per bucket per optimizer step. A backward run with sync on every time still trains right (averaging values equal
on every rank changes nothing), at one reduction per micro step.

Parameters are looked up at each training forward, not once: a model built on ``meta`` and filled by the
streaming load gets new parameter objects after ``replicate``; the buckets are planned again when that happens.

Why not torch's DDP: it rejects a mix of Tensor and DTensor parameters (TP x DP); torch's FSDP2-based
``replicate`` on torch 2.13 CPU segfaulted or trained nothing after a forward under ``no_grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dist.data_parallel.buckets import DEFAULT_BUCKET_MB, Bucket, plan_buckets


class GradientReducer:
    """Averages the gradients of ``module``'s trainable parameters over ``group``, bucketed (module docstring)."""

    def __init__(self, module: nn.Module, group, *, bucket_cap_mb: float = DEFAULT_BUCKET_MB,
                 params_of: Callable[[nn.Module], list[nn.Parameter]] | None = None, divisor: int | None = None):
        """``params_of(module)``: the parameters this reducer owns (default: every trainable one); ``divisor``: what
        the summed gradients are divided by (default: the group's size -- expert shards summed over the ``efsdp``
        ranks are divided by the whole dp size, their ``ep`` peers' batches reaching them through the dispatch)."""
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be positive; the default is {DEFAULT_BUCKET_MB}")
        self.module, self.group = module, group
        self.size = divisor if divisor is not None else dist.get_world_size(group)
        self.params_of = params_of or (lambda m: [p for p in m.parameters() if p.requires_grad])
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        self.requires_sync = True
        self.overlapped = 0
        """Buckets of the latest synced backward whose all_reduce started before the backward ended."""
        self.buckets: list[Bucket] = []
        self._params: list[nn.Parameter] = []
        self._handles: list = []
        self._reset()
        module.register_forward_pre_hook(self._check_parameters)

    # -- control ---------------------------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """False: backward accumulates gradients locally; True: the next backward reduces them."""
        self.requires_sync = requires_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (DDP's ``no_sync``)."""
        before = self.requires_sync
        self.requires_sync = False
        try:
            yield
        finally:
            self.requires_sync = before

    # -- planning --------------------------------------------------------------------------------
    def _check_parameters(self, module: nn.Module, args) -> None:
        """Plan buckets and hooks for the current trainable parameters, if they changed since the last plan."""
        if not torch.is_grad_enabled():
            return
        if self._finish_queued:  # the last synced backward raised (e.g. out of memory): forget what it started
            self._reset()
        params = self.params_of(module)
        if len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params)):
            return
        if any(p.is_meta for p in params):  # not loaded yet: plan once the parameters hold values
            return
        for handle in self._handles:
            handle.remove()
        self._params = params
        # gradients arrive roughly in reverse registration order: the first bucket is the first one ready
        self.buckets = plan_buckets(params[::-1], self.cap_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]
        self._reset()

    # -- reduction -------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._ready_count = [0] * len(self.buckets)
        self._next = 0  # the next bucket to start: buckets start in order, on every rank the same
        self._inflight: list[tuple[Bucket, torch.Tensor, object]] = []
        self._finish_queued = False

    def _ready(self, param: nn.Parameter) -> None:
        if not self.requires_sync:
            return
        if not self._finish_queued:
            # runs once the whole backward is done (FSDP2 and DDP end their backward the same way)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        index = self._bucket_of[id(param)]
        self._ready_count[index] += 1
        while self._next < len(self.buckets) and self._ready_count[self._next] == len(self.buckets[self._next].params):
            self._start(self._next)

    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        flat = bucket.flatten()
        self._inflight.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        self._next = index + 1

    def _finish(self) -> None:
        """End of a synced backward: start what is left (gradients missing here count as zeros), wait, write back."""
        try:
            self.overlapped = self._next
            while self._next < len(self.buckets):
                self._start(self._next)
            for bucket, flat, work in self._inflight:
                work.wait()
                bucket.unflatten(flat, self.size)
        finally:
            self._reset()


def replicate(model: nn.Module, dp_mesh, *, bucket_cap_mb: float = DEFAULT_BUCKET_MB,
              experts: tuple[Callable[[nn.Module], list[nn.Parameter]], object, int] | None = None) -> nn.Module:
    """Plain data parallelism over ``dp_mesh``, in place: parameters broadcast from dp rank 0 (as DDP does at
    construction), gradients averaged in buckets of ``bucket_cap_mb`` MiB (module docstring).

    ``experts``: ``(params_of, efsdp_mesh, dp)`` under expert parallelism: the expert shards (``params_of``: all
    of them, frozen ones too -- LoRA on a frozen base) differ between the ``ep`` ranks, so they are broadcast over
    ``efsdp_mesh`` (the ranks holding the same experts) and, the trainable ones, summed there by a second reducer
    and divided by ``dp``; the first reducer keeps the other parameters.

    The model gains ``no_sync()``, ``set_requires_gradient_sync(bool)`` and ``gradient_reducer`` (its buckets).
    """
    group = dp_mesh.get_group()
    excluded = {id(p) for p in experts[0](model)} if experts else set()
    _broadcast([p for p in model.parameters() if id(p) not in excluded], group)

    def dense_of(module: nn.Module) -> list[nn.Parameter]:
        expert_ids = {id(p) for p in experts[0](module)}
        return [p for p in module.parameters() if p.requires_grad and id(p) not in expert_ids]

    reducers = [GradientReducer(model, group, bucket_cap_mb=bucket_cap_mb, params_of=dense_of if experts else None)]
    if experts:
        params_of, efsdp_mesh, dp = experts
        _broadcast(params_of(model), efsdp_mesh.get_group())
        reducers.append(GradientReducer(model, efsdp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb,
                                        params_of=lambda m: [p for p in params_of(m) if p.requires_grad],
                                        divisor=dp))

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for reducer in reducers:
                stack.enter_context(reducer.no_sync())
            yield

    def set_requires_gradient_sync(requires_sync: bool) -> None:
        for reducer in reducers:
            reducer.set_requires_gradient_sync(requires_sync)

    # plain attributes (not a subclass): accelerate's no_sync looks for ``model.no_sync``
    model.gradient_reducer = reducers[0]
    model.gradient_reducers = reducers
    model.no_sync = no_sync
    model.set_requires_gradient_sync = set_requires_gradient_sync
    return model


def _broadcast(params: list[nn.Parameter], group) -> None:
    src = dist.get_global_rank(group, 0)
    for param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        if not local.is_meta:  # meta: filled later by the streaming load, the same on every rank
            dist.broadcast(local.data, src=src, group=group)

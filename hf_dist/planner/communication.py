"""Communication time of one optimizer step on a layout: the ledger minimum's bytes over each link's bandwidth.

The bytes are ``hf_dist.metrics.ledger_minimum.layout_minimum``'s -- the definition ``tests/test_ledger.py`` pins
measured counts against -- for the shape of one rank (``step_shape``: its TP / PP / EP part of the parameters, in the
dtypes the layout gathers and reduces (``hf_dist.precision.tensor_dtypes``), its micro-batches and activation
checkpointing; under PP the stage with more parameters). Each row's bytes cross the wire as a ring moves them, with
the bus factors nccl-tests uses: all-reduce ``2(n-1)/n``, all-gather, reduce-scatter and all-to-all ``(n-1)/n``,
send and receive 1. A group whose ranks stay inside one node runs at the GPU kind's intra-node bandwidth, a group
that spans nodes at its inter-node bandwidth per GPU (``gpus.py``; ``ParallelDims.axis_span`` says which). The rows
of one kind run one after another. Data-parallel rows (over ``DATA_PARALLEL_AXES``: FSDP2/ZeRO gathers and
reduce-scatters, DDP's gradient all-reduce) can hide behind compute (FSDP2 prefetches the next unit while one
computes; gradients are reduced bucket by bucket during backward): ``Communication.overlappable_s``. TP, PP, EP and
CP transfers sit between the computations that need them: ``Communication.exposed_s``.

Not here: compute time, and how the two add up to a step (``throughput.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_dist.metrics.ledger_minimum import StepShape, layout_minimum
from hf_dist.planner.catalogue import GpuSpec, ModelSpec
from hf_dist.planner.states import gathered_itemsize, local_param_shapes, lora_shapes
from hf_dist.planner.workload import Layout, Workload
from hf_dist.precision import itemsize, tensor_dtypes

DATA_PARALLEL_AXES = frozenset({"world", "dp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp", "efsdp"})
"""Mesh axes whose collectives synchronise parameters and gradients: they can overlap compute."""


@dataclass(kw_only=True, frozen=True)
class Links:
    """Bytes per second per GPU, per direction, of the two link classes."""

    intra_node: float
    """Inside a node (NVLink, or PCIe)."""
    inter_node: float
    """Between nodes (the network, per GPU)."""

    def __post_init__(self) -> None:
        for name in ("intra_node", "inter_node"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} bandwidth={getattr(self, name)!r} must be positive (bytes/s)")

    @classmethod
    def of(cls, gpu: GpuSpec, *, intra_node: float | None = None, inter_node: float | None = None) -> Links:
        """The GPU kind's links, or the bandwidths given (measured, e.g. ``hf-dist doctor``'s busbw)."""
        return cls(intra_node=intra_node or gpu.intra_node_bytes_per_s, inter_node=inter_node or gpu.inter_node_bytes_per_s)


@dataclass(kw_only=True, frozen=True)
class LinkRow:
    """One row of the ledger minimum, timed."""

    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, send, recv."""
    axis: str
    """The mesh axis (``ParallelDims`` name) its group runs over."""
    ranks: int
    """Ranks in the group."""
    inter_node: bool
    """Whether the group spans nodes."""
    overlappable: bool
    """Data-parallel traffic, which can run while compute does."""
    bytes: int
    """The ledger minimum's bytes (tensor sizes, as the ledger counts them)."""
    seconds: float
    """Bus bytes over the link's bandwidth."""


@dataclass(kw_only=True, frozen=True)
class Communication:
    """What one rank communicates in one optimizer step, and how long it takes."""

    rows: tuple[LinkRow, ...]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def overlappable_s(self) -> float:
        """Seconds of data-parallel traffic, which can hide behind compute."""
        return sum(r.seconds for r in self.rows if r.overlappable)

    @property
    def exposed_s(self) -> float:
        """Seconds of TP, PP, EP and CP traffic, on the critical path."""
        return sum(r.seconds for r in self.rows if not r.overlappable)

    @property
    def intra_node_s(self) -> float:
        return sum(r.seconds for r in self.rows if not r.inter_node)

    @property
    def inter_node_s(self) -> float:
        return sum(r.seconds for r in self.rows if r.inter_node)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "overlappable_s": self.overlappable_s, "exposed_s": self.exposed_s,
                "intra_node_s": self.intra_node_s, "inter_node_s": self.inter_node_s,
                "rows": [r.__dict__ for r in self.rows]}


def bus_factor(kind: str, ranks: int) -> float:
    """Bytes on the busiest link per byte of the collective's tensor (nccl-tests' bus bandwidth convention)."""
    if kind in ("send", "recv"):
        return 1.0
    share = (ranks - 1) / ranks
    return 2 * share if kind == "all_reduce" else share


def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def _stage_shape(model: ModelSpec, workload: Workload, layout: Layout, *, layers: int, first: bool,
                 last: bool) -> StepShape:
    base = list(local_param_shapes(model, layout, layers=layers, first=first, last=last))
    adapters = list(lora_shapes(model, layout.lora_rank, layers)) if layout.lora_rank else []
    gathered, reduced = gathered_itemsize(workload, layout), itemsize(tensor_dtypes(layout, workload.precision).reduction)
    trained = _numel(s for _, s in (adapters or base))
    experts = _numel(s for n, s in base if n.startswith("mlp.experts.")) if layout.ep > 1 else 0
    # under SP the norms run on sequence shards with their weights whole: partial gradients, summed once per step
    sp_norms = _numel(s for n, s in base if n == "norm" or n.endswith("layernorm.weight")) if layout.sequence_parallel \
        else 0
    return StepShape(
        layers=layers, hidden=model.hidden_size, q_dim=model.q_dim, kv_dim=model.kv_dim,
        param_bytes=gathered * _numel(s for _, s in base + adapters), expert_param_bytes=gathered * experts,
        trained_param_bytes=gathered * trained, grad_bytes=reduced * trained,
        expert_grad_bytes=0 if adapters else reduced * experts, units=layers + 1,
        tokens_per_micro=workload.tokens, micro_batches=workload.gradient_accumulation_steps,
        top_k=model.experts_per_token, element_size=4 if workload.precision == "fp32" else 2,
        recompute=workload.activation_checkpointing, sp_partial_bytes=reduced * sp_norms)


def step_shape(model: ModelSpec, workload: Workload, layout: Layout) -> StepShape:
    """The ledger minimum's ``StepShape`` of one rank of ``layout`` (under PP: the stage with more parameters)."""
    pp, total = layout.pp, model.num_hidden_layers
    if pp == 1:
        return _stage_shape(model, workload, layout, layers=total, first=True, last=True)
    layers = math.ceil(total / pp)
    stages = (_stage_shape(model, workload, layout, layers=layers, first=True, last=False),
              _stage_shape(model, workload, layout, layers=total - layers * (pp - 1), first=False, last=True))
    return max(stages, key=lambda s: s.param_bytes)


def communication(model: ModelSpec, workload: Workload, layout: Layout, links: Links) -> Communication:
    """The ledger minimum of ``layout`` for one rank, each row timed on its link class."""
    dims, rows = layout.dims, []
    for m in layout_minimum(layout, step_shape(model, workload, layout)):
        ranks, stride = dims.axis_span(m.axis)
        inter = ranks * stride > layout.num_gpus
        bandwidth = links.inter_node if inter else links.intra_node
        rows.append(LinkRow(kind=m.kind, axis=m.axis, ranks=ranks, inter_node=inter,
                            overlappable=m.axis in DATA_PARALLEL_AXES, bytes=m.bytes,
                            seconds=m.bytes * bus_factor(m.kind, ranks) / bandwidth))
    return Communication(rows=tuple(rows))


__all__ = ["DATA_PARALLEL_AXES", "Communication", "LinkRow", "Links", "bus_factor", "communication", "step_shape"]

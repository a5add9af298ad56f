"""The theoretical minimum communication and FLOPs of one optimizer step under a layout, from its definition.

Pure: names and numbers in, rows out (no process group). ``minimum(layout, shape, dims)`` lists what one of the
ledger's layouts must communicate per rank per optimizer step; ``compare(measured, minima)`` puts a ``StepLedger``
(averaged over ranks) beside it. ``layout_minimum(layout, shape)`` composes the same per-parallelism rows for any
``hf_dist.strategy.Layout``: it is where ``hf-dist plan`` takes its communication bytes from (``hf_dist.planner.
communication``), so the planner and the ledger's pins share one definition. The definitions:

- replicated DP (DDP, hf_dist's buckets): one all-reduce of every gradient byte per optimizer step;
- FSDP2 FULL_SHARD (and ZeRO-3): each unit's parameters all-gathered once in forward and once in backward, its
  gradients reduce-scattered once per optimizer step (units: the blocks, the untied embedding and head, and the root);
  SHARD_GRAD_OP and ZeRO-1/2 gather once per step (ZeRO-1/2 only the trained parameters); HYBRID_SHARD shards
  inside a replica and all-reduces the shards' gradients over the replicas; routed experts under EP are sharded (or
  replicated, DDP) over ``efsdp``;
- TP without sequence parallelism (Megatron): per transformer block 2 all-reduces of the activations in forward
  (attention out, MLP out) and 2 in backward (attention in, MLP in); with sequence parallelism each is an
  all-gather and a reduce-scatter;
- PP: per micro-batch and stage boundary one activation forward and one gradient backward (per rank: a send and a
  receive per micro-batch on a 2-stage pipeline);
- EP: per MoE layer a dispatch and a combine all-to-all of the routed tokens (tokens x top-k x hidden) in forward,
  the same two in backward;
- CP (all-to-all, Ulysses): per attention layer the all-to-all of q, k, v and the output, forward and backward;
- FLOPs: 6 x N_active x tokens + attention (``hf_dist.planner.flops``), plus a forward under checkpointing;
- activation checkpointing (``StepShape.recompute``) runs each layer's forward again in backward, with its TP, EP
  and CP collectives (FSDP2 gathers the unit for its backward anyway).

Collectives of under ``SMALL_BYTES`` per call are control traffic (token counts, norms, split sizes, stop flags),
tallied on their own rows so they do not hide in the data rows.

Not here: counting (``hf_dist.metrics.ledger``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from hf_dist.strategy import Layout as StrategyLayout

SMALL_BYTES = 1024
"""A call moving fewer bytes than this is control traffic, not data."""
Layout = Literal["ddp", "fsdp2", "zero3", "tp", "tp_sp", "pp", "ep_fsdp2", "cp"]


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What the minimum depends on: the model, the batch one rank sees, the element size."""

    layers: int
    """Decoder layers one rank runs (a pipeline stage's under PP)."""
    hidden: int
    q_dim: int
    """Query heads x head dim."""
    kv_dim: int
    """Key/value heads x head dim."""
    param_bytes: int
    """Every parameter one rank holds before data-parallel sharding (the whole model, or its TP / PP / EP part), in
    the gathered dtype."""
    expert_param_bytes: int = 0
    """Of which routed experts (sharded over ``efsdp``, not the data-parallel ranks; none gathered at ``efsdp == 1``)."""
    trained_param_bytes: int | None = None
    """Of ``param_bytes`` the trained ones (LoRA: the adapters), in the gathered dtype; None: all."""
    grad_bytes: int | None = None
    """The trained parameters' gradients in the reduce dtype; None: ``trained_param_bytes``."""
    expert_grad_bytes: int | None = None
    """Of which routed experts'; None: ``expert_param_bytes``."""
    units: int = 0
    """FSDP2 units (blocks + root, + the input embedding and the head where they are not tied)."""
    tokens_per_micro: int
    """Tokens of one micro-batch on one rank, before a CP split."""
    micro_batches: int = 1
    """Micro-batches per rank per optimizer step (accumulation, or the pipeline's micro-batches)."""
    top_k: int = 0
    element_size: int = 4
    """Bytes of an activation element (what TP, PP, EP and CP move)."""
    recompute: bool = False
    """Activation checkpointing: each layer's forward runs again in backward, with its TP, EP and CP collectives."""
    sp_partial_bytes: int = 0
    """Under TP sequence parallelism, the weights kept whole on every TP rank whose gradients come out partial per
    rank (the norms), in the reduce dtype: summed over the TP ranks once per step (0: not counted)."""

    @property
    def trained(self) -> int:
        return self.param_bytes if self.trained_param_bytes is None else self.trained_param_bytes

    @property
    def grads(self) -> int:
        return self.trained if self.grad_bytes is None else self.grad_bytes

    @property
    def expert_grads(self) -> int:
        return self.expert_param_bytes if self.expert_grad_bytes is None else self.expert_grad_bytes

    @property
    def forward_passes(self) -> int:
        """Forward passes per micro-batch whose layer collectives run: 1, or 2 under activation checkpointing."""
        return 2 if self.recompute else 1


@dataclass(frozen=True, kw_only=True)
class Minimum:
    kind: str
    axis: str
    """A mesh axis name the measured group must carry (``"world"`` for the default group)."""
    count: int
    bytes: int
    small: bool = False
    """A control row (calls under ``SMALL_BYTES``)."""
    dtype: str = ""
    """The dtype the measured row must have (empty: any)."""
    rule: str


# -- one definition per parallelism: the ledger's layouts and the planner's (``layout_minimum``) compose these --

def replicated_rows(grads: int, axis: str) -> list[Minimum]:
    """Replicated data parallelism (DDP, hf_dist's buckets): one all-reduce of every gradient byte per step."""
    return [Minimum(kind="all_reduce", axis=axis, count=1, bytes=grads, rule="every gradient once per step")]


def sharded_rows(params: int, grads: int, axis: str, *, units: int, gathers: int = 2) -> list[Minimum]:
    """Sharded data parallelism: each unit's parameters all-gathered ``gathers`` times (FSDP2 FULL_SHARD and ZeRO-3:
    forward and backward; SHARD_GRAD_OP and ZeRO-1/2: once), its gradients reduce-scattered once per step."""
    rule = "each unit gathered in forward and in backward" if gathers == 2 else "each unit gathered once per step"
    return [Minimum(kind="all_gather", axis=axis, count=gathers * units, bytes=gathers * params, rule=rule),
            Minimum(kind="reduce_scatter", axis=axis, count=units, bytes=grads,
                    rule="each unit's gradients once per step")]


def _activation(s: StepShape) -> int:
    return s.tokens_per_micro * s.hidden * s.element_size * s.micro_batches


def tp_rows(s: StepShape, *, sequence_parallel: bool = False) -> list[Minimum]:
    """Megatron TP: per block 2 all-reduces of the activations in forward (attention out, MLP out) and 2 in backward
    (attention in, MLP in), the forward's again under recompute. Sequence parallel splits each all-reduce into an
    all-gather and a reduce-scatter of the same tensor (the same bytes on the wire), and sums the norms' partial
    gradients over the TP ranks once per step (``StepShape.sp_partial_bytes``, one bucket)."""
    per_block = 2 * s.forward_passes + 2
    count, size = per_block * s.layers * s.micro_batches, per_block * s.layers * _activation(s)
    if sequence_parallel:
        rows = [Minimum(kind=k, axis="tp", count=count, bytes=size,
                        rule="sequence parallel: each Megatron all-reduce as a gather + a scatter")
                for k in ("all_gather", "reduce_scatter")]
        if s.sp_partial_bytes:
            rows.append(Minimum(kind="all_reduce", axis="tp", count=1, bytes=s.sp_partial_bytes,
                                small=s.sp_partial_bytes < SMALL_BYTES,
                                rule="the norms' partial gradients, one bucket per step"))
        return rows
    return [Minimum(kind="all_reduce", axis="tp", count=count, bytes=size,
                    rule="Megatron: 2 forward + 2 backward per block" + (" + 2 recomputed" if s.recompute else ""))]


def pp_rows(s: StepShape, *, stages: int = 2) -> list[Minimum]:
    """PP: per micro-batch and stage boundary one activation forward and one gradient backward. Per rank: a send
    and a receive per micro-batch on a 2-stage pipeline; a middle stage (``stages > 2``) has two boundaries."""
    boundaries = 2 if stages > 2 else 1
    per = _activation(s) // s.micro_batches
    return [Minimum(kind=k, axis="pp", count=boundaries * s.micro_batches, bytes=boundaries * s.micro_batches * per,
                    rule="one activation (or its gradient) per micro-batch per boundary") for k in ("send", "recv")]


def ep_rows(s: StepShape) -> list[Minimum]:
    """EP: per MoE layer a dispatch and a combine all-to-all of the routed tokens (tokens x top-k x hidden) in
    forward (again under recompute), the same two in backward."""
    routed = s.tokens_per_micro * s.micro_batches * s.top_k * s.hidden * s.element_size
    calls = 2 * s.forward_passes + 2
    return [Minimum(kind="all_to_all", axis="ep", count=calls * s.layers, bytes=calls * s.layers * routed,
                    rule="dispatch + combine of routed tokens, forward and backward")]


def cp_rows(s: StepShape, cp: int, *, tp: int = 1) -> list[Minimum]:
    """CP (all-to-all, Ulysses): per attention layer the all-to-all of q, k, v and the output, forward (again under
    recompute) and backward; each rank holds ``1/cp`` of the tokens and, under TP, ``1/tp`` of the heads."""
    local = s.tokens_per_micro // cp * s.micro_batches * s.element_size
    passes = s.forward_passes + 1
    a2a = passes * s.layers * (2 * s.q_dim + 2 * s.kv_dim) // tp * local
    return [Minimum(kind="all_to_all", axis="cp", count=4 * passes * s.layers, bytes=a2a,
                    rule="q, k, v, out per attention layer, forward and backward")]


def _data_rows(layout: Layout, s: StepShape, *, dp: int, cp: int) -> list[Minimum]:
    if layout == "ddp":
        return replicated_rows(s.grads, "world")
    if layout == "zero3":
        return sharded_rows(s.param_bytes, s.grads, "world", units=s.units)
    if layout in ("fsdp2", "ep_fsdp2"):
        return sharded_rows(s.param_bytes - s.expert_param_bytes, s.grads - s.expert_grads, "dp_shard",
                            units=s.units) + (ep_rows(s) if layout == "ep_fsdp2" else [])
    if layout in ("tp", "tp_sp"):
        return tp_rows(s, sequence_parallel=layout == "tp_sp")
    if layout == "pp":
        return pp_rows(s)
    if layout == "cp":
        return cp_rows(s, cp) + replicated_rows(s.grads, "dp_cp")
    raise ValueError(f"no minimum for layout {layout!r}; layouts are ddp, fsdp2, zero3, tp, tp_sp, pp, ep_fsdp2, cp")


def layout_minimum(layout: StrategyLayout, s: StepShape) -> list[Minimum]:
    """The data rows one rank of ``layout`` (``hf_dist.strategy.Layout``, any composition of the parallelisms above)
    must at least communicate in one optimizer step, each on the ``ParallelDims`` axis it runs over; groups of one
    rank move nothing and have no row. What ``hf-dist plan`` turns into communication time."""
    dims = layout.dims
    dense, dense_grads = s.param_bytes - s.expert_param_bytes, s.grads - s.expert_grads
    rows: list[Minimum] = []
    if layout.strategy == "ddp":
        if dims.dp_cp > 1:
            rows += replicated_rows(dense_grads, "dp_cp" if dims.cp > 1 else "dp")
    elif layout.strategy == "fsdp_hybrid_shard":
        rows += sharded_rows(dense, dense_grads, "dp_shard", units=s.units) if dims.dp_shard > 1 else []
        if dims.dp_replicate > 1:  # the replicas average their shards
            rows += replicated_rows(dense_grads // dims.dp_shard, "dp_replicate")
    elif layout.shard_degree > 1:
        full = layout.strategy in ("fsdp_full_shard", "zero3")
        # ZeRO-1/2 partition only what is trained (the optimizer's groups); FSDP2 shards every parameter
        gathered = dense if layout.is_fsdp or full else s.trained - s.expert_param_bytes
        axis = "dp_shard_cp" if dims.cp > 1 else ("dp" if layout.is_deepspeed else "dp_shard")
        rows += sharded_rows(gathered, dense_grads, axis, units=s.units, gathers=2 if full else 1)
    if layout.ep > 1 and layout.efsdp > 1 and s.expert_param_bytes:  # the ranks holding the same experts
        rows += (sharded_rows(s.expert_param_bytes, s.expert_grads, "efsdp", units=s.layers) if layout.is_fsdp
                 else replicated_rows(s.expert_grads, "efsdp"))
    if layout.tp > 1:
        rows += tp_rows(s, sequence_parallel=layout.sequence_parallel)
    if layout.pp > 1:
        rows += pp_rows(s, stages=layout.pp)
    if layout.ep > 1:
        rows += ep_rows(s)
    if layout.cp > 1:
        rows += cp_rows(s, layout.cp, tp=layout.tp)
    return rows


def _control_rows(layout: Layout, *, dp: int) -> list[Minimum]:
    rows = []
    if dp > 1:  # ranks with different batches agree on the loss divisor
        rows.append(Minimum(kind="all_gather", axis="world", count=1, bytes=8 * dp, small=True, dtype="int64",
                            rule="the batch's token count (the loss divisor)"))
    if layout in ("fsdp2", "zero3", "ep_fsdp2", "tp", "tp_sp", "pp"):  # gradients sharded or split: the norm is a sum
        wide = layout == "zero3"  # DeepSpeed sums the norm in float64
        rows.append(Minimum(kind="all_reduce", axis="world", count=1, bytes=8 if wide else 4, small=True,
                            dtype="float64" if wide else "float32", rule="the gradient norm for clipping"))
    return rows


def minimum(layout: Layout, shape: StepShape, *, dp: int = 1, cp: int = 1) -> list[Minimum]:
    """The rows one rank must at least communicate in one optimizer step of ``layout``."""
    return _data_rows(layout, shape, dp=dp, cp=cp) + _control_rows(layout, dp=dp)


@dataclass(frozen=True, kw_only=True)
class Row:
    kind: str
    group: str
    dtype: str
    small: bool
    count: float
    bytes: float
    minimum: Minimum | None


def measured_rows(ledgers: list[dict]) -> list[Row]:
    """Each rank's ``StepLedger.plain()`` averaged over ranks, split into data and control (small) calls."""
    totals: dict[tuple, list[float]] = {}
    for ledger in ledgers:
        for key, tally in ledger["comms"].items():
            if key.kind == "barrier":
                continue
            for size in tally.sizes:
                row = totals.setdefault((key.kind, key.group, key.dtype, size < SMALL_BYTES), [0.0, 0.0])
                row[0] += 1 / len(ledgers)
                row[1] += size / len(ledgers)
    return [Row(kind=k, group=g, dtype=d, small=s, count=c, bytes=b, minimum=None)
            for (k, g, d, s), (c, b) in sorted(totals.items())]


def compare(rows: list[Row], minima: list[Minimum]) -> list[Row]:
    """``rows`` with their minimum (the first unused one of the same kind, size class and axis); minima never
    measured come last with a zero count."""
    unused = list(minima)
    out = []
    for row in rows:
        match = next((m for m in unused if m.kind == row.kind and m.small == row.small
                      and m.dtype in ("", row.dtype) and m.axis in row.group.split("/")), None)
        if match is not None:
            unused.remove(match)
        out.append(Row(**{**row.__dict__, "minimum": match}))
    out += [Row(kind=m.kind, group=m.axis, dtype="-", small=m.small, count=0, bytes=0, minimum=m) for m in unused]
    return out


def ratio(measured: float, least: float) -> str:
    if least == 0:
        return "-" if measured == 0 else "extra"
    return f"{measured / least:.2f}"

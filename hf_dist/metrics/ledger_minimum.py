"""The theoretical minimum communication and FLOPs of one optimizer step under a layout, from its definition.

Pure: names and numbers in, rows out (no process group). ``minimum(layout, shape, dims)`` lists what a layout must
communicate per rank per optimizer step; ``compare(measured, minima)`` puts a ``StepLedger`` (averaged over ranks)
beside it. The definitions:

- replicated DP (DDP, hf_dist's buckets): one all-reduce of every gradient byte per optimizer step;
- FSDP2 FULL_SHARD: each unit's parameters all-gathered once in forward and once in backward, its gradients
  reduce-scattered once per optimizer step (units: the blocks and the root);
- TP without sequence parallelism (Megatron): per transformer block 2 all-reduces of the activations in forward
  (attention out, MLP out) and 2 in backward (attention in, MLP in);
- PP: per micro-batch and stage boundary one activation forward and one gradient backward (per rank: a send and a
  receive per micro-batch on a 2-stage pipeline);
- EP: per MoE layer a dispatch and a combine all-to-all of the routed tokens (tokens x top-k x hidden) in forward,
  the same two in backward;
- CP (all-to-all, Ulysses): per attention layer the all-to-all of q, k, v and the output, forward and backward;
- FLOPs: 6 x N_active x tokens + attention (``hf_dist.planner.flops``), plus a forward under checkpointing.

Collectives of under ``SMALL_BYTES`` per call are control traffic (token counts, norms, split sizes, stop flags),
tallied on their own rows so they do not hide in the data rows.

Not here: counting (``hf_dist.metrics.ledger``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SMALL_BYTES = 1024
"""A call moving fewer bytes than this is control traffic, not data."""
Layout = Literal["ddp", "fsdp2", "tp", "pp", "ep_fsdp2", "cp"]


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What the minimum depends on: the model, the batch one rank sees, the element size."""

    layers: int
    hidden: int
    q_dim: int
    """Query heads x head dim."""
    kv_dim: int
    """Key/value heads x head dim."""
    param_bytes: int
    """Every parameter of the whole model, in the communicated dtype."""
    expert_param_bytes: int = 0
    """Of which routed experts (not sharded by FSDP2 when ``efsdp == 1``)."""
    units: int = 0
    """FSDP2 units (blocks + root)."""
    tokens_per_micro: int
    """Tokens of one micro-batch on one rank, before a CP split."""
    micro_batches: int = 1
    """Micro-batches per rank per optimizer step (accumulation, or the pipeline's micro-batches)."""
    top_k: int = 0
    element_size: int = 4


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


def _data_rows(layout: Layout, s: StepShape, *, dp: int, cp: int) -> list[Minimum]:
    grads = s.param_bytes
    act = s.tokens_per_micro * s.hidden * s.element_size * s.micro_batches
    if layout == "ddp":
        return [Minimum(kind="all_reduce", axis="world", count=1, bytes=grads, rule="every gradient once per step")]
    if layout in ("fsdp2", "ep_fsdp2"):
        sharded = grads - s.expert_param_bytes
        return [Minimum(kind="all_gather", axis="dp_shard", count=2 * s.units, bytes=2 * sharded,
                        rule="each unit gathered in forward and in backward"),
                Minimum(kind="reduce_scatter", axis="dp_shard", count=s.units, bytes=sharded,
                        rule="each unit's gradients once per step")] + (
            _ep_rows(s) if layout == "ep_fsdp2" else [])
    if layout == "tp":
        return [Minimum(kind="all_reduce", axis="tp", count=4 * s.layers * s.micro_batches, bytes=4 * s.layers * act,
                        rule="Megatron: 2 forward + 2 backward per block")]
    if layout == "pp":
        per = act // s.micro_batches
        return [Minimum(kind=k, axis="pp", count=s.micro_batches, bytes=s.micro_batches * per,
                        rule="one activation (or its gradient) per micro-batch per boundary") for k in ("send", "recv")]
    if layout == "cp":
        local = s.tokens_per_micro // cp * s.micro_batches * s.element_size
        a2a = 2 * s.layers * (2 * s.q_dim + 2 * s.kv_dim) * local
        return [Minimum(kind="all_to_all", axis="cp", count=8 * s.layers, bytes=a2a,
                        rule="q, k, v, out per attention layer, forward and backward"),
                Minimum(kind="all_reduce", axis="dp_cp", count=1, bytes=grads, rule="every gradient once per step")]
    raise ValueError(f"no minimum for layout {layout!r}; layouts are ddp, fsdp2, tp, pp, ep_fsdp2, cp")


def _ep_rows(s: StepShape) -> list[Minimum]:
    routed = s.tokens_per_micro * s.micro_batches * s.top_k * s.hidden * s.element_size
    return [Minimum(kind="all_to_all", axis="ep", count=4 * s.layers, bytes=4 * s.layers * routed,
                    rule="dispatch + combine of routed tokens, forward and backward")]


def _control_rows(layout: Layout, *, dp: int) -> list[Minimum]:
    rows = []
    if dp > 1:  # ranks with different batches agree on the loss divisor
        rows.append(Minimum(kind="all_gather", axis="world", count=1, bytes=8 * dp, small=True, dtype="int64",
                            rule="the batch's token count (the loss divisor)"))
    if layout in ("fsdp2", "ep_fsdp2", "tp", "pp"):  # gradients sharded or split: the clipping norm is a sum
        rows.append(Minimum(kind="all_reduce", axis="world", count=1, bytes=4, small=True, dtype="float32",
                            rule="the gradient norm for clipping"))
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

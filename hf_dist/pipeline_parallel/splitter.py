"""Split a decoder-only causal LM into pipeline stages: pure planning, names and numbers only.

``plan_stages`` takes the decoder layers (name, parameter count) in order, the size of the embeddings and of
the head (final norm + lm_head), and returns ``pp_size x virtual_stages`` contiguous stages. The first stage
always owns the embeddings, the last stage the final norm and lm_head. Stages are balanced by parameter count
(the split that minimises the largest stage) or cut at explicit split points.

Which rank runs which stage is part of the plan: ``"loop"`` placement puts stage ``i`` on rank ``i % pp_size``
(GPipe, 1F1B, interleaved schedules), ``"v"`` placement puts stages ``r`` and ``2p - 1 - r`` on rank ``r``
(the ZB-V schedule).

Not for: building modules or touching a process group (see ``stage_module`` and ``pipeline``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Placement = Literal["loop", "v"]
EMBED_FQNS: tuple[str, ...] = ("model.embed_tokens",)
HEAD_FQNS: tuple[str, ...] = ("model.norm", "lm_head")


@dataclass(kw_only=True, frozen=True)
class StagePlan:
    """Which module names each pipeline stage owns, and which pp rank runs it."""

    stages: tuple[tuple[str, ...], ...]
    """Module FQNs per stage, in pipeline order (stage 0 first). Decoder layers keep their HF names."""
    pp_size: int
    """Number of pipeline ranks."""
    placement: Placement = "loop"
    """How stages map to ranks: ``loop`` (stage i on rank i % pp) or ``v`` (rank r holds r and 2p-1-r)."""
    stage_sizes: tuple[int, ...] = ()
    """Parameter count per stage (same order as ``stages``)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.pp_size

    def rank_of(self, stage_index: int) -> int:
        """The pp rank that runs ``stage_index``."""
        if not 0 <= stage_index < self.num_stages:
            raise ValueError(f"stage_index={stage_index} is outside 0..{self.num_stages - 1}")
        if self.placement == "loop":
            return stage_index % self.pp_size
        round_, offset = divmod(stage_index, self.pp_size)
        return offset if round_ % 2 == 0 else self.pp_size - 1 - offset

    def local_stages(self, pp_rank: int) -> list[int]:
        """Stage indices run by ``pp_rank``, in pipeline order."""
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={pp_rank} is outside 0..{self.pp_size - 1}")
        return [i for i in range(self.num_stages) if self.rank_of(i) == pp_rank]

    def describe(self) -> str:
        """A one-line-per-stage table: stage, rank, parameter count, first..last module."""
        lines = []
        for i, names in enumerate(self.stages):
            size = self.stage_sizes[i] if self.stage_sizes else 0
            lines.append(f"stage {i} (rank {self.rank_of(i)}): {size:,} params, {names[0]} .. {names[-1]}")
        return "\n".join(lines)


def _balanced_cuts(costs: Sequence[int], parts: int, first_extra: int, last_extra: int) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty groups of ``costs``: the smallest possible largest group,
    and among the splits that reach it, the most even one (least sum of squared group sizes).

    ``first_extra``/``last_extra`` are added to the first/last group (embeddings, head). Two exact dynamic
    programmes, O(parts x n^2) each: n is the number of decoder layers (at most a few hundred).
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def group(i: int, j: int, k: int) -> int:  # cost of layers [i, j) as group k
        extra = (first_extra if k == 0 else 0) + (last_extra if k == parts - 1 else 0)
        return prefix[j] - prefix[i] + extra

    def solve(combine, feasible) -> list[int]:
        """best[k][j]: the best value when layers [0, j) form groups 0..k; returns the group starts."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(parts)]
        cut = [[0] * (n + 1) for _ in range(parts)]
        for j in range(1, n + 1):
            if feasible(group(0, j, 0)):
                best[0][j] = combine(0, group(0, j, 0))
        for k in range(1, parts):
            for j in range(k + 1, n + 1):
                for i in range(k, j):
                    g = group(i, j, k)
                    if best[k - 1][i] == inf or not feasible(g):
                        continue
                    value = combine(best[k - 1][i], g)
                    if value < best[k][j]:
                        best[k][j], cut[k][j] = value, i
        starts, j = [], n
        for k in range(parts - 1, 0, -1):
            j = cut[k][j]
            starts.append(j)
        return [0, *reversed(starts)]

    starts = solve(lambda acc, g: max(acc, g), lambda g: True)
    bounds = [*starts, n]
    largest = max(group(bounds[k], bounds[k + 1], k) for k in range(parts))
    return solve(lambda acc, g: acc + g * g, lambda g: g <= largest)


def _cuts_from_split_points(layer_names: Sequence[str], split_points: Sequence[str], parts: int) -> list[int]:
    if len(split_points) != parts - 1:
        raise ValueError(
            f"split_points has {len(split_points)} entries, but {parts} stages need exactly {parts - 1} "
            f"(each names the decoder layer a new stage starts at, e.g. {layer_names[len(layer_names) // 2]!r})"
        )
    index = {name: i for i, name in enumerate(layer_names)}
    unknown = [p for p in split_points if p not in index]
    if unknown:
        raise ValueError(
            f"split_points {unknown} are not decoder layers; use names from {layer_names[0]!r} .. {layer_names[-1]!r}"
        )
    cuts = [index[p] for p in split_points]
    if cuts != sorted(set(cuts)) or cuts[0] == 0:
        raise ValueError(
            f"split_points={list(split_points)} must be strictly increasing and not start at the first layer "
            f"{layer_names[0]!r}; every stage needs at least one decoder layer"
        )
    return [0, *cuts]


def plan_stages(
    layers: Sequence[tuple[str, int]],
    *,
    pp_size: int,
    virtual_stages: int = 1,
    embed_size: int = 0,
    head_size: int = 0,
    split_points: Sequence[str] | None = None,
    placement: Placement = "loop",
    embed_fqns: Sequence[str] = EMBED_FQNS,
    head_fqns: Sequence[str] = HEAD_FQNS,
) -> StagePlan:
    """Split decoder ``layers`` (``(fqn, num_params)`` in model order) into ``pp_size x virtual_stages`` stages.

    Args:
        layers: the decoder layers in order, with their parameter counts.
        pp_size: pipeline ranks.
        virtual_stages: stages per rank (>1 for interleaved and V schedules).
        embed_size: parameters of the embeddings, counted on the first stage when balancing.
        head_size: parameters of the final norm + lm_head, counted on the last stage.
        split_points: decoder-layer names at which stages 1..S-1 start; ``None`` balances by parameter count.
        placement: ``loop`` or ``v`` (see ``StagePlan.placement``).
        embed_fqns / head_fqns: the module names added to the first / last stage.
    """
    for name, value in (("pp_size", pp_size), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if placement not in ("loop", "v"):
        raise ValueError(f"placement={placement!r} is not known; use 'loop' or 'v'")
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"placement='v' needs virtual_stages=2 (two stages per rank), got {virtual_stages}")
    parts = pp_size * virtual_stages
    names = [name for name, _ in layers]
    if len(names) < parts:
        raise ValueError(
            f"{len(names)} decoder layers cannot fill pp_size={pp_size} x virtual_stages={virtual_stages} = {parts} "
            f"stages (each stage needs at least one layer); use pp_size x virtual_stages <= {len(names)}"
        )
    if split_points is None:
        starts = _balanced_cuts([size for _, size in layers], parts, embed_size, head_size)
    else:
        starts = _cuts_from_split_points(names, split_points, parts)
    bounds = [*starts, len(names)]
    stages, sizes = [], []
    for k in range(parts):
        lo, hi = bounds[k], bounds[k + 1]
        owned = names[lo:hi]
        size = sum(size for _, size in layers[lo:hi])
        if k == 0:
            owned, size = [*embed_fqns, *owned], size + embed_size
        if k == parts - 1:
            owned, size = [*owned, *head_fqns], size + head_size
        stages.append(tuple(owned))
        sizes.append(size)
    return StagePlan(stages=tuple(stages), pp_size=pp_size, placement=placement, stage_sizes=tuple(sizes))

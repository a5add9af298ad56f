"""The mark a model carries once hf_dist has laid it out, so that nothing lays it out a second time.

``hf_dist.from_pretrained`` returns a model already sharded for its ``DistTrainingArguments``; ``DistTrainer``
reads the mark (``laid_out_by_hf_dist``), checks it is the layout its own arguments ask for, and reuses the
mesh instead of applying the layout again. A model whose parameters are DTensors without the mark was laid
out by something else and is refused: hf_dist cannot tell what was done to it.

Not for: applying a layout (the layout path) or loading weights (``hf_dist.loading``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hf_dist.parallel_dims import ParallelDims

LAYOUT_ATTR = "_hf_dist_laid_out"


@dataclass(kw_only=True, frozen=True)
class LaidOut:
    """What was applied to a model; stored on it as ``model._hf_dist_laid_out``."""

    dims: ParallelDims
    """The layout, mesh built."""
    fsdp: bool
    """Whether the data-parallel ranks shard parameters (FSDP2)."""
    flops: object
    """``hf_dist.planner.flops.FlopCounts`` of the whole model, counted before the layout (a pipeline rank holds
    only its stages'), for the throughput meter."""
    load: object = None
    """The ``hf_dist.loading.LoadReport`` of the streaming load that filled this rank's shards (what it read)."""
    head_unit: bool | None = None
    """FSDP2: whether an untied lm_head is a unit of its own (``FsdpRequest.head_unit``); None: not recorded."""


def stamp(model: nn.Module, laid_out: LaidOut) -> nn.Module:
    object.__setattr__(model, LAYOUT_ATTR, laid_out)  # not a submodule, not a parameter
    return model


def _factors(dims: ParallelDims) -> dict[str, int]:
    return {name: getattr(dims, name) for name in ("world_size", "pp", "dp_replicate", "dp_shard", "cp", "tp")}


def laid_out_by_hf_dist(model: nn.Module, wanted: ParallelDims, *, head_unit: bool | None = None) -> LaidOut | None:
    """The mark of a model hf_dist laid out for ``wanted``; ``None`` for a model nobody laid out.

    A mark for another layout, or DTensor parameters without a mark, is a ``ValueError``; so is an FSDP2 head laid
    out otherwise than ``head_unit`` asks (TRL's fused LM head needs it in the root, ``FsdpRequest.head_unit``).
    """
    laid_out = model.__dict__.get(LAYOUT_ATTR)
    if laid_out is None:
        if hasattr(model, "pipeline") or any(hasattr(p, "device_mesh") for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} is already sharded (DTensor parameters or pipeline stages) but not by "
                f"hf_dist.from_pretrained, so DistTrainer cannot tell its layout; pass the model before any "
                f"sharding, or load it with hf_dist.from_pretrained(name_or_dir, args)"
            )
        return None
    have, want = _factors(laid_out.dims), _factors(wanted)
    if have != want:
        raise ValueError(
            f"the model was laid out for {have} but these arguments ask for {want}; build it with "
            f"hf_dist.from_pretrained(name_or_dir, args) using the same arguments you pass to DistTrainer"
        )
    if None not in (laid_out.head_unit, head_unit) and laid_out.head_unit != head_unit:
        where = {True: "an FSDP2 unit of its own", False: "in the FSDP2 root"}
        raise ValueError(
            f"the model was laid out with its lm_head {where[laid_out.head_unit]}, but these arguments' trainer keeps "
            f"it {where[head_unit]} (TRL's fused LM head reads lm_head.weight in the root's forward: "
            f"reads_lm_head_weight={not head_unit}); build it with hf_dist.from_pretrained(name_or_dir, args) using "
            f"the same arguments (config class included) you pass to the trainer"
        )
    return laid_out

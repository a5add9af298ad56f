"""Pipeline schedules by name, micro-batch checks, and the typed pipeline configuration.

Maps ``PipelineConfig.schedule`` to the ``torch.distributed.pipelining`` schedule class, the number of
stages per rank it runs and how stages are placed on ranks. Checks the micro-batch count against the batch
(an error when the batch does not split evenly) and against the number of stages (a warning, once, on the
main process, when there are fewer than 2 x stages micro-batches: the pipeline bubble then dominates).

Not for: splitting the model (``splitter``) or running steps (``pipeline``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

logger = logging.getLogger(__name__)

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]


@dataclass(kw_only=True, frozen=True)
class ScheduleSpec:
    """How one schedule runs: its torch class, stages per rank and stage placement."""

    class_name: str
    """Class in ``torch.distributed.pipelining``."""
    multi_stage: bool
    """True when the schedule drives several stages per rank (interleaved, V)."""
    placement: Literal["loop", "v"]
    """Stage-to-rank placement the schedule expects."""
    fixed_virtual_stages: int | None = None
    """Stages per rank the schedule requires (None: configurable, >= 2 for multi-stage schedules)."""


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(class_name="ScheduleGPipe", multi_stage=False, placement="loop", fixed_virtual_stages=1),
    "1f1b": ScheduleSpec(class_name="Schedule1F1B", multi_stage=False, placement="loop", fixed_virtual_stages=1),
    "interleaved_1f1b": ScheduleSpec(class_name="ScheduleInterleaved1F1B", multi_stage=True, placement="loop"),
    "interleaved_zb": ScheduleSpec(class_name="ScheduleInterleavedZeroBubble", multi_stage=True, placement="loop"),
    "zbv": ScheduleSpec(class_name="ScheduleZBVZeroBubble", multi_stage=True, placement="v", fixed_virtual_stages=2),
}


@dataclass(kw_only=True)
class PipelineConfig:
    """What a pipeline-parallel run needs beyond the layout (``ParallelDims.pp``)."""

    schedule: ScheduleName = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, interleaved_zb (zero bubble) or zbv (zero bubble, V)."""
    microbatches: int = 4
    """Micro-batches per step and data-parallel rank; the per-rank batch must split into them evenly."""
    virtual_stages: int | None = None
    """Stages per rank. None: 1 for gpipe/1f1b, 2 for interleaved_* and zbv (zbv requires 2)."""
    split_points: tuple[str, ...] | None = None
    """Decoder-layer names where stages 1..S-1 start (e.g. ``("model.layers.16",)``); None: balance by params."""
    pad_to_multiple_of: int = 64
    """Training batches are right-padded (masked, labels -100) to a multiple of this many tokens. torch's
    pipeline stages fix activation shapes per schedule, so one schedule is built per padded length: batches whose
    length changes from step to step (a collator padding to the longest row) then cost few schedules."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.schedule!r} is not known; use one of {', '.join(SCHEDULES)}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"pp_microbatches={self.microbatches!r} must be a positive integer")
        spec = SCHEDULES[self.schedule]
        if self.virtual_stages is None:
            self.virtual_stages = spec.fixed_virtual_stages or 2
        if spec.fixed_virtual_stages is not None and self.virtual_stages != spec.fixed_virtual_stages:
            raise ValueError(
                f"pp_schedule={self.schedule!r} runs exactly {spec.fixed_virtual_stages} stage(s) per rank, got "
                f"virtual_stages={self.virtual_stages}; leave virtual_stages unset or pick an interleaved schedule"
            )
        if spec.multi_stage and self.virtual_stages < 2:
            raise ValueError(
                f"pp_schedule={self.schedule!r} interleaves several stages per rank, got virtual_stages="
                f"{self.virtual_stages}; use virtual_stages >= 2, or pp_schedule='1f1b'"
            )
        if self.split_points is not None:
            self.split_points = tuple(self.split_points)
        if not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive integer (1: no padding)")

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]


def microbatch_problem(schedule: str, microbatches: int, pp: int) -> str | None:
    """Why torch's ``schedule`` cannot run ``microbatches`` per step over ``pp`` ranks; None when it can (pure).

    1F1B needs at least one micro-batch per stage; the interleaved schedules run rounds of ``pp`` micro-batches and
    need a count that splits into whole rounds (``torch.distributed.pipelining.schedules``); GPipe and ZB-V take any.
    """
    if schedule == "1f1b" and microbatches < pp:
        return f"pp_schedule='1f1b' needs at least pp_size={pp} micro-batches per step (one per stage)"
    if schedule.startswith("interleaved"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return (f"pp_schedule={schedule!r} runs rounds of pp_size={pp} micro-batches and {microbatches} does not "
                    f"split into {rounds} equal rounds")
    return None


def smallest_valid_microbatches(schedule: str, pp: int, at_least: int = 1) -> int:
    """The smallest micro-batch count >= ``at_least`` that ``schedule`` runs over ``pp`` ranks (pure)."""
    m = max(1, at_least)
    while microbatch_problem(schedule, m, pp) is not None:
        m += 1
    return m


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message)


def check_microbatches(batch_size: int, microbatches: int, num_stages: int) -> int:
    """The micro-batch size for ``batch_size`` sequences in ``microbatches`` pieces over ``num_stages`` stages.

    Raises ``ValueError`` when the batch does not split evenly; warns once when ``microbatches < 2 x stages``.
    """
    if batch_size % microbatches != 0:
        divisors = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        raise ValueError(
            f"a batch of {batch_size} sequences per data-parallel rank does not split into pp_microbatches="
            f"{microbatches} equal micro-batches; use pp_microbatches in {divisors} or a batch that is a multiple "
            f"of {microbatches}"
        )
    if microbatches < 2 * num_stages:
        _warn_once(
            f"few-microbatches-{microbatches}-{num_stages}",
            f"pp_microbatches={microbatches} is below 2 x {num_stages} pipeline stages: each stage idles for "
            f"about (stages - 1) / (microbatches + stages - 1) of the step; use pp_microbatches >= {2 * num_stages}",
        )
    return batch_size // microbatches


def build_schedule(config: PipelineConfig, stages: list, loss_fn) -> object:
    """The torch schedule object for this rank's ``PipelineStage`` list (gradients not rescaled by torch)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, config.spec.class_name)
    if config.spec.multi_stage:
        return cls(stages, n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"pp_schedule={config.schedule!r} runs one stage per rank, got {len(stages)}")
    return cls(stages[0], n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=False)


def theoretical_utilisation(microbatches: int, pp_size: int) -> float:
    """Busy fraction of a fill-drain pipeline: ``m / (m + p - 1)`` (bubble ``(p - 1) / (m + p - 1)``)."""
    return microbatches / (microbatches + pp_size - 1)

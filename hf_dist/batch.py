"""The global-batch contract and learning-rate scaling.

The user declares the global batch (sequences per optimizer step) and the micro batch (sequences per
forward on one data-parallel rank). Accumulation is derived::

    accumulation = global_batch / (micro_batch x dp)

where ``dp`` counts data-parallel ranks only: tensor- and pipeline-parallel ranks of one group read the
same batch, so they are not data-parallel. The learning rate is scaled from a reference
(``base_learning_rate`` at ``base_batch_size``) by ``none``, ``linear`` or ``sqrt``.

Pure arithmetic: no process group, no torch. The Trainer glue and the ``hf-dist batch`` CLI use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LrScaling = Literal["none", "linear", "sqrt"]
LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")


def nearest_valid_global_batches(global_batch: int, micro_batch: int, dp: int, count: int = 2) -> list[int]:
    """The multiples of ``micro_batch x dp`` nearest to ``global_batch`` (below and above)."""
    unit = micro_batch * dp
    below = (global_batch // unit) * unit
    candidates = [below - unit * i for i in range(count)] + [below + unit * (i + 1) for i in range(count)]
    return sorted({c for c in candidates if c > 0}, key=lambda c: (abs(c - global_batch), c))[:count]


def scale_learning_rate(base_lr: float, base_batch: int, global_batch: int, rule: str) -> float:
    """``base_lr`` scaled from ``base_batch`` to ``global_batch`` by ``rule``."""
    if rule not in LR_SCALINGS:
        raise ValueError(f"lr_scaling={rule!r} is not a known rule; use one of {', '.join(LR_SCALINGS)}")
    if rule == "none":
        return base_lr
    if base_batch <= 0:
        raise ValueError(f"base_batch_size={base_batch} must be positive to scale the learning rate")
    ratio = global_batch / base_batch
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))


@dataclass(kw_only=True, frozen=True)
class BatchContract:
    """A resolved batch layout: what each rank does per micro step and per optimizer step."""

    world_size: int
    """Processes in the job."""
    global_batch_size: int
    """Sequences per optimizer step, across all data-parallel ranks and accumulation steps."""
    micro_batch_size: int
    """Sequences per forward/backward on one data-parallel rank."""
    tp: int = 1
    """Tensor-parallel degree (ranks that share a batch)."""
    pp: int = 1
    """Pipeline-parallel degree (ranks that share a batch)."""
    cp: int = 1
    """Context-parallel degree (ranks that share a batch, each holding a slice of every sequence)."""
    seq_len: int | None = None
    """Tokens per sequence, for the tokens-per-step figure (None: unknown)."""
    base_learning_rate: float | None = None
    """Reference learning rate (None: no scaling, the table shows the LR as given)."""
    base_batch_size: int | None = None
    """Global batch at which ``base_learning_rate`` was tuned (None: this run's global batch)."""
    lr_scaling: LrScaling = "none"
    """How the learning rate follows the global batch."""

    def __post_init__(self) -> None:
        for name in ("world_size", "global_batch_size", "micro_batch_size", "tp", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        shared = self.tp * self.pp * self.cp
        if self.world_size % shared != 0:
            raise ValueError(
                f"tp={self.tp} x pp={self.pp} x cp={self.cp} = {shared} does not divide world_size={self.world_size}; "
                f"use a world size that is a multiple of {shared}, or smaller tp/pp/cp"
            )
        unit = self.micro_batch_size * self.dp
        if self.global_batch_size % unit != 0:
            near = nearest_valid_global_batches(self.global_batch_size, self.micro_batch_size, self.dp)
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
                f"{self.micro_batch_size} x data-parallel size={self.dp} (world_size={self.world_size}, "
                f"tp={self.tp}, pp={self.pp}, cp={self.cp}) = {unit}, so gradient accumulation would not be a whole number; "
                f"use global_batch_size in {near}, or change the micro batch"
            )
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"lr_scaling={self.lr_scaling!r} is not a known rule; use one of {', '.join(LR_SCALINGS)}")
        if self.lr_scaling != "none" and self.base_learning_rate is None:
            raise ValueError(f"lr_scaling={self.lr_scaling!r} needs base_learning_rate; set it or use lr_scaling='none'")
        base_lr = self.base_learning_rate
        if base_lr is not None and not (isinstance(base_lr, (int, float)) and math.isfinite(base_lr) and base_lr > 0):
            raise ValueError(
                f"base_learning_rate={base_lr!r} must be a positive finite number (the learning rate tuned at "
                f"base_batch_size, e.g. 2e-5)"
            )
        if self.base_batch_size is not None and self.base_batch_size < 1:
            raise ValueError(f"base_batch_size={self.base_batch_size} must be a positive integer")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def tokens_per_step(self) -> int | None:
        return None if self.seq_len is None else self.global_batch_size * self.seq_len

    @property
    def learning_rate(self) -> float | None:
        if self.base_learning_rate is None:
            return None
        base_batch = self.base_batch_size or self.global_batch_size
        return scale_learning_rate(self.base_learning_rate, base_batch, self.global_batch_size, self.lr_scaling)

    def resized(self, world_size: int) -> "BatchContract":
        """The same global batch on another world size (resume elsewhere): accumulation is re-derived."""
        return BatchContract(**{**self.as_dict(), "world_size": world_size})

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "seq_len": self.seq_len,
            "base_learning_rate": self.base_learning_rate,
            "base_batch_size": self.base_batch_size,
            "lr_scaling": self.lr_scaling,
        }

    def table(self) -> str:
        """The resolved table printed at start."""
        rows = [
            ("world size", str(self.world_size)),
            ("data parallel (dp)", str(self.dp)),
            ("tensor parallel (tp)", str(self.tp)),
            ("pipeline parallel (pp)", str(self.pp)),
            *([("context parallel (cp)", str(self.cp))] if self.cp > 1 else []),
            ("micro batch / dp rank", str(self.micro_batch_size)),
            ("gradient accumulation", str(self.gradient_accumulation_steps)),
            (
                "global batch",
                f"{self.global_batch_size} = {self.micro_batch_size} x {self.dp} x {self.gradient_accumulation_steps}",
            ),
            (
                "tokens / step",
                "unknown" if self.tokens_per_step is None else f"{self.tokens_per_step:,} ({self.seq_len} / sequence)",
            ),
        ]
        if self.learning_rate is not None:
            base_batch = self.base_batch_size or self.global_batch_size
            rows.append(
                (
                    "learning rate",
                    f"{self.base_learning_rate:g} @ {base_batch} -> {self.learning_rate:g} ({self.lr_scaling})",
                )
            )
        width = max(len(k) for k, _ in rows)
        lines = ["hf_dist batch contract", "-" * (width + 24)]
        lines += [f"{key:<{width}}  {value}" for key, value in rows]
        return "\n".join(lines)

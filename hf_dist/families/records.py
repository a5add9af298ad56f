"""What hf_dist knows about one causal-LM model type: one frozen record (``Family``) per type.

A record says which parallelisms are *proven* for the type (a parity test against one process passes for it: the
value names the test) and which are *refused by name* (the reason). Whatever is neither is refused by the run as
unproven. The support decisions of each parallelism (``hf_dist.*_parallel.support``), the planner and the coverage
table read these records; they hold no list of model types of their own.

Pure data: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

Kind = Literal["dense", "moe", "hybrid", "classic", "unknown"]
"""dense: attention + MLP decoder layers with transformers' plans; moe: routed experts; hybrid: linear-attention,
short-conv or state-space layers beside attention; classic: the older types transformers ships no plans for (hf_dist
writes them); unknown: a type hf_dist has no record for (nothing proven)."""

Parallelism = Literal["tp", "pp", "ep", "cp", "ep_pp"]
TpPlanSource = Literal["model", "hf_dist"]
"""model: transformers' ``base_model_tp_plan`` (and the head's ``_tp_plan``) with hf_dist's overlays; hf_dist:
hf_dist's own plan (``tensor_parallel/classic.py`` ``CLASSIC_TP``, ``tensor_parallel/moe.py`` ``OWN_PLANS``), used
even when the installed transformers ships a plan for the type."""
PARALLELISMS: tuple[Parallelism, ...] = ("tp", "pp", "ep", "cp", "ep_pp")
"""The cells a record may prove or refuse: each parallelism, and the products whose composition needs its own parity
test beyond both factors' (``ep_pp``: experts sharded over each pipeline stage's data-parallel ranks, the router
statistics passed between stages)."""


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model type's record."""

    model_type: str
    kind: Kind
    proven: Mapping[Parallelism, str] = field(default_factory=dict)
    """Parallelism -> the parity test (against one process) that proves it for this type."""
    refused: Mapping[Parallelism, str] = field(default_factory=dict)
    """Parallelism -> why it cannot run on this type (named refusals; checked before anything else)."""
    notes: Mapping[Parallelism, str] = field(default_factory=dict)
    """Parallelism -> how it runs on this type (shown in the coverage tables)."""
    tp_plan: TpPlanSource = "model"
    """Whose TP plan runs for this type (``TpPlanSource``). A type where both exist names the one its parity test
    proves; transformers adding a plan later (5.24: gptj, codegen, gpt_oss) changes nothing until this changes."""
    pp_layer_output: int | None = None
    """Override of what the model's code says about its decoder layers' output (``pipeline_parallel.layer_output``
    reads it from the base model's layer loop): 0, a tensor; n, a tuple of n. ``None``: read from the code."""

    def __post_init__(self) -> None:
        for name in ("proven", "refused", "notes"):
            mapping = dict(getattr(self, name))
            unknown = sorted(set(mapping) - set(PARALLELISMS))
            if unknown:
                raise ValueError(f"{self.model_type}: {name} names {unknown}; parallelisms are {PARALLELISMS}")
            object.__setattr__(self, name, MappingProxyType(mapping))
        both = sorted(set(self.proven) & set(self.refused))
        if both:
            raise ValueError(f"{self.model_type}: {both} both proven and refused")

    def proves(self, parallelism: Parallelism) -> bool:
        """Whether a parity test proves ``parallelism`` on this type."""
        return parallelism in self.proven

"""The model-family registry: what hf_dist knows about each causal-LM model type, in one place.

``family(model_type)`` returns the type's frozen ``Family`` record (``records``; the rows are in ``table``): which
parallelisms a parity test proves for it, which are refused by name and why, and the facts about its code that the
layouts need. ``fields`` reads the config values whose names differ by type (expert counts, heads). Every decision
to run or refuse a (model type, layout) cell is taken from these records by the support modules of each
parallelism, and ``hf_dist.support.model_refusals`` asks them all.
"""

from __future__ import annotations

from hf_dist.families.fields import EXPERT_COUNT_FIELDS, attention_heads, expert_count_field, num_experts, text_config
from hf_dist.families.records import PARALLELISMS, Family, Kind, Parallelism, PlannerShape
from hf_dist.families.table import FAMILIES

__all__ = [
    "EXPERT_COUNT_FIELDS", "FAMILIES", "PARALLELISMS", "Family", "Kind", "Parallelism", "PlannerShape",
    "attention_heads", "expert_count_field", "family", "family_of", "num_experts", "proven_types", "text_config",
    "types_with",
]


def family(model_type: str | None) -> Family:
    """The record of ``model_type``; an ``unknown`` record (nothing proven) for a type the registry does not list."""
    known = FAMILIES.get(model_type)
    return known if known is not None else Family(model_type=str(model_type), kind="unknown")


def family_of(config) -> Family:
    """The record of ``config``'s model type (``family``)."""
    return family(getattr(config, "model_type", None))


def types_with(fact: str) -> tuple[str, ...]:
    """The model types whose records set ``fact`` (a ``Family`` field), in table order."""
    return tuple(t for t, f in FAMILIES.items() if getattr(f, fact))


def proven_types(parallelism: Parallelism, *, kinds: tuple[Kind, ...] | None = None) -> frozenset[str]:
    """The model types (of ``kinds``, default all) whose records prove ``parallelism``."""
    return frozenset(t for t, f in FAMILIES.items() if f.proves(parallelism) and (kinds is None or f.kind in kinds))

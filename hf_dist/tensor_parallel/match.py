"""Which modules of a model a tensor-parallel plan names: ``*`` patterns over module paths.

Shared by ``apply`` (sharding the modules) and ``lora`` (rewriting plan entries for LoRA layers).
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def match_plan(
    model: nn.Module, plan: dict[str, ParallelStyle], *, optional: frozenset[str] = frozenset()
) -> list[tuple[str, ParallelStyle]]:
    """``(module_name, style)`` for every module a pattern names; a pattern naming nothing is an error unless
    it is in ``optional`` (the head, absent from a pipeline stage that does not own it)."""
    names = [name for name, _ in model.named_modules()]
    matched: list[tuple[str, ParallelStyle]] = []
    for pattern, style in plan.items():
        regex = _pattern_regex(pattern)
        hits = [name for name in names if regex.fullmatch(name)]
        if not hits and pattern not in optional:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__}; "
                f"check the path (e.g. {names[1:4]}) or remove the entry"
            )
        matched.extend((name, style) for name in hits)
    return matched

"""FSDP2 communication overlap made explicit: which block's all-gather is issued while another block computes.

FSDP2's implicit prefetch issues a block's all-gather when its forward (or backward) starts; on a CPU-bound or
launch-bound step that leaves each block waiting for its own parameters. ``set_explicit_prefetch`` tells each block
to all-gather the next block's parameters at the start of its forward, and the previous block's at the start of
its backward (torchtitan's order: the blocks run forward in list order, backward in reverse). ``reshard_after_forward``
says which blocks free their gathered parameters after forward: all but the last, whose parameters backward needs
first (resharding it would only all-gather it again at once).

Not for: sharding itself (``hf_dist.parallelism.apply_fsdp``) or gradient reduction (``hf_dist.data_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def reshard_after_forward(index: int, count: int, *, requested: bool, explicit_prefetch: bool) -> bool:
    """Whether block ``index`` of ``count`` frees its gathered parameters after forward (the last keeps them)."""
    return requested and not (explicit_prefetch and index == count - 1)


def set_explicit_prefetch(units: Sequence[nn.Module]) -> None:
    """Each FSDP unit prefetches the next one in forward and the previous one in backward."""
    units = list(units)
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])

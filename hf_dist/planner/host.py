"""Host RAM per node: what loading the model and offloading its states need, against what the node has.

Two phases, each per node (``gpus_per_node`` ranks), each with DeepSpeed's ``additional_buffer_factor`` (1.5,
``MemoryAssumptions.host_buffer_factor``) for pinned staging buffers and allocator slack, as its estimators use:

  * ``loading``: how the weights reach the ranks. ``every_rank`` (``from_pretrained`` on every rank, what the
    Trainer does; the recipe loads fp32 for a full fine-tune): the whole model per rank in its load dtype.
    ZeRO-3 loads through transformers' ``deepspeed.zero.Init``, so a rank holds about one layer at a time
    (DeepSpeed's ``zero_init`` estimate: 4 bytes x the largest layer per rank). ``streaming`` (meta-device init,
    then each rank reads its own slices): a rank's share plus the largest tensor.
  * ``offload``: the bytes each rank keeps in CPU memory during training (``MemoryBreakdown.cpu_offload``):
    DeepSpeed's 16 bytes/parameter at ZeRO-1/2 and 18 at ZeRO-3 with parameters (the figures in
    ``estimate_zero2/3_model_states_mem_needs``), FSDP's 16 (fp32 parameter, gradient and Adam shards).

A layout whose offload does not fit the node's RAM cannot train and is refused; a loading peak that does not
fit is a warning with the fix (the steady state fits; the load can be made to fit).

Not here: GPU memory (``memory.py``) or the host RAM of each GPU kind (``catalogue.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hf_dist.planner.catalogue import ModelSpec
from hf_dist.planner.layout import Layout, Workload
from hf_dist.planner.memory import MemoryAssumptions, MemoryBreakdown

Loading = Literal["every_rank", "streaming"]
LOADINGS: tuple[str, ...] = ("every_rank", "streaming")


@dataclass(kw_only=True, frozen=True)
class HostMemory:
    """Host RAM per node, in bytes."""

    loading: int
    """Peak while the model is loaded."""
    offload: int
    """During training: what the node's ranks offload, with the buffer factor."""
    how_loaded: str
    """How the loading figure was counted."""

    @property
    def peak(self) -> int:
        return max(self.loading, self.offload)


def _load_bytes_per_param(workload: Workload, layout: Layout) -> int:
    """The dtype weights are loaded in: fp32 for a full fine-tune with an fp32 master, bf16 otherwise."""
    if workload.precision == "pure_bf16" or (layout.lora_rank and workload.precision != "fp32"):
        return 2
    return 4


def host_memory(model: ModelSpec, workload: Workload, layout: Layout, memory: MemoryBreakdown, *,
                loading: Loading = "every_rank", assumptions: MemoryAssumptions | None = None) -> HostMemory:
    """Host RAM per node of ``layout`` for loading and for offload."""
    if loading not in LOADINGS:
        raise ValueError(f"loading={loading!r} is not known; use one of {', '.join(LOADINGS)}")
    factor = (assumptions or MemoryAssumptions()).host_buffer_factor
    ranks = layout.num_gpus
    per_param = _load_bytes_per_param(workload, layout)
    largest = max(model.layer_params, model.embedding_params)
    if layout.strategy == "zero3":
        per_rank, how = 4 * largest, "ZeRO-3 zero.Init: one layer at a time per rank, fp32"
    elif loading == "streaming":
        per_rank = per_param * (math.ceil(model.num_params / layout.world_size) + largest)
        how = "streaming: each rank its share and the largest tensor"
    else:
        per_rank = per_param * model.num_params
        how = f"every rank loads the whole model ({'fp32' if per_param == 4 else 'bf16'})"
    return HostMemory(loading=int(per_rank * ranks * factor), offload=int(memory.cpu_offload * ranks * factor),
                      how_loaded=how)


__all__ = ["LOADINGS", "HostMemory", "Loading", "host_memory"]

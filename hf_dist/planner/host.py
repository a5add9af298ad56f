"""Host RAM per node: what loading the model and offloading its states need, against what the node has.

Two phases, each per node (``gpus_per_node`` ranks), each with DeepSpeed's ``additional_buffer_factor`` (1.5,
``MemoryAssumptions.host_buffer_factor``) for pinned staging buffers and allocator slack, as its estimators use:

  * ``loading``: how the weights reach the ranks. ``auto`` (the default) is what ``hf_dist.from_pretrained``
    and the recipe do for the layout (``hf_dist.strategy.streams_weights``): ``streaming`` for FSDP2, TP and PP
    (meta-device init, then each rank reads its own slices: the part of the model the rank keeps, plus the
    largest tensor), transformers' loader for DDP and DeepSpeed. ``every_rank`` (``from_pretrained`` on every
    rank, what a script calling transformers itself does): the whole model per rank in its load dtype (fp32
    for a full fine-tune). ZeRO-3 loads through transformers' ``deepspeed.zero.Init`` in every mode, so a rank
    holds about one layer at a time (DeepSpeed's ``zero_init`` estimate: 4 bytes x the largest layer per rank).
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
from hf_dist.planner.workload import Layout, Workload
from hf_dist.planner.memory import MemoryAssumptions, MemoryBreakdown

Loading = Literal["auto", "every_rank", "streaming"]
LOADINGS: tuple[str, ...] = ("auto", "every_rank", "streaming")


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
                loading: Loading = "auto", assumptions: MemoryAssumptions | None = None) -> HostMemory:
    """Host RAM per node of ``layout`` for loading and for offload."""
    if loading not in LOADINGS:
        raise ValueError(f"loading={loading!r} is not known; use one of {', '.join(LOADINGS)}")
    factor = (assumptions or MemoryAssumptions()).host_buffer_factor
    per_rank, how = _load_per_rank(model, workload, layout, loading)
    ranks = layout.num_gpus
    return HostMemory(loading=int(per_rank * ranks * factor), offload=int(memory.cpu_offload * ranks * factor),
                      how_loaded=how)


def _load_per_rank(model: ModelSpec, workload: Workload, layout: Layout, loading: Loading) -> tuple[int, str]:
    """Host bytes one rank holds while loading, and how that was counted."""
    per_param = _load_bytes_per_param(workload, layout)
    largest = max(model.layer_params, model.embedding_params)
    if layout.strategy == "zero3":
        return 4 * largest, "ZeRO-3 zero.Init: one layer at a time per rank, fp32"
    dtype = "fp32" if per_param == 4 else "bf16"
    if loading == "streaming" or (loading == "auto" and layout.streaming_load):
        # the ranks the module's weights are split over (ZeRO-1/2 modules hold whole parameters)
        keeps = (layout.shard_degree if layout.is_fsdp else 1) * layout.tp * layout.pp
        by = "hf_dist.from_pretrained" if loading == "auto" else "--loading streaming"
        return (per_param * (math.ceil(model.num_params / keeps) + largest),
                f"streaming ({by}): each rank the 1/{keeps} it keeps and the largest tensor, {dtype}")
    by = "transformers' loader, which hf_dist.from_pretrained keeps for DDP and DeepSpeed" if loading == "auto" \
        else "--loading every_rank"
    return per_param * model.num_params, f"every rank loads the whole model in {dtype} ({by})"


__all__ = ["LOADINGS", "HostMemory", "Loading", "host_memory"]

"""DCP planners for DTensors whose local shard is several blocks of the whole tensor.

Tensor parallelism splits MoE experts' fused ``[gate | up]`` part by part (``_StridedShard(split_factor=2)``,
``tensor_parallel/moe.py``): rank r holds ``[gate_r | up_r]``, two blocks of the global tensor. DTensor's own
checkpoint hooks describe a local shard as one block at one offset, which would write ``[gate_r | up_r]`` as if it
were rows ``r*n ... (r+1)*n`` of the fused tensor. DCP's checkpoint format itself holds any number of chunks per
rank (ShardedTensor writes several): ``BlockSavePlanner`` writes one chunk per block and ``BlockLoadPlanner`` reads
each block from whatever chunks overlap it (DCP's own resharding, ``create_read_items_for_chunk_list``). The entry
keeps its name, global shape and HF row order, so a checkpoint written under TP is the same as one written by one
process: it resumes on any layout and exports without knowing that TP wrote it. Nothing is gathered or copied: the
blocks are views of the local shard (reads go straight into the parameter or optimizer state).

Which blocks a rank holds is ``loading.slices.strided_blocks`` (each placement's own split of the indices).
Not here: what goes into the state dict (``api``), reading non-tensor entries safely (``safe_io``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from hf_dist.loading.slices import local_tensor, multi_block, strided_blocks

Block = tuple[ChunkStorageMetadata, torch.Tensor]


def _blocks(value: DTensor) -> list[Block]:
    """``(chunk of the global tensor, view of the local shard)`` for each block this rank holds."""
    local = local_tensor(value)
    out = []
    for local_index, global_index in strided_blocks(value):
        offsets = torch.Size(s.start for s in global_index)
        sizes = torch.Size(s.stop - s.start for s in global_index)
        out.append((ChunkStorageMetadata(offsets=offsets, sizes=sizes), local[local_index]))
    return out


def _multi_block_entries(state_dict: dict) -> dict[str, list[Block]]:
    return {fqn: _blocks(value) for fqn, value in state_dict.items()
            if multi_block(value) and value.device_mesh.get_coordinate() is not None}


def _block_at(blocks: dict[str, list[Block]], index: MetadataIndex) -> torch.Tensor:
    for chunk, view in blocks[index.fqn]:
        if chunk.offsets == index.offset:
            return view
    raise ValueError(f"{index.fqn}: this rank holds no block at offset {tuple(index.offset)}")


class BlockSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes a multi-block DTensor as one chunk per block (module docstring)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # DTensor's hooks give a multi-block entry one (wrong) chunk: replaced
        self._blocks = _multi_block_entries(self.state_dict)
        items = [
            WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(view),
                                                  size=self.state_dict[fqn].size()))
            for fqn, blocks in self._blocks.items() for chunk, view in blocks
        ]
        self.plan = _replace_items(plan, self._blocks, items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in getattr(self, "_blocks", {}):
            return _block_at(self._blocks, index)
        return super().lookup_object(index)


class BlockLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads each block of a multi-block DTensor into its view (module docstring)."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()  # checks keys and global sizes; the multi-block reads are replaced
        self._blocks = _multi_block_entries(self.state_dict)
        stored = self.metadata.state_dict_metadata
        items = [item for fqn, blocks in self._blocks.items() if fqn in stored
                 for item in create_read_items_for_chunk_list(fqn, stored[fqn], [chunk for chunk, _ in blocks])]
        return _replace_items(plan, self._blocks, items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in getattr(self, "_blocks", {}):
            return _block_at(self._blocks, index)
        return super().lookup_tensor(index)


def _replace_items(plan, blocks: dict, items: list):
    """``plan`` with its items for the ``blocks`` entries replaced by ``items``."""
    if not blocks:
        return plan
    kept = [i for i in plan.items if getattr(i, "index", getattr(i, "dest_index", None)).fqn not in blocks]
    return dataclasses.replace(plan, items=kept + items)

"""hf_dist's writer of a Hub-format weights folder: shard plan, ``*.safetensors`` files and their index.

hf_dist's own paths that write model weights as ``save_pretrained`` would go through ``write_weights``: the final
save of a trained model (``hf_dist.state_dict``, from every rank, tensors fetched one at a time), the pipeline's save
(``pipeline_parallel.save``) and the exporters (``hf_dist.checkpoint.export``, ``hf_dist.checkpoint.zero``). Two
paths leave the writing to the libraries: ``state_dict.save_gathered`` saves a PEFT adapter with PEFT's
``save_pretrained``, and the native exporter re-saves with transformers' ``save_pretrained`` a checkpoint whose
tensors transformers assembles from several stored ones. The
plan is huggingface_hub's own (``split_torch_state_dict_into_shards`` on ``meta`` tensors: names, global shapes and
dtypes only, nothing allocated), so the file names, the split and the index are what ``save_pretrained`` writes.
The tensors of one output file are then asked for, written and dropped, so a writer holds about one file.

Not for: config, tokenizer or adapter files (the callers write those), or resumable checkpoints (DCP,
``hf_dist.checkpoint``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_dist.file_modes import save_safetensors

MODEL_FILES = "model{suffix}.safetensors"
"""A model's files (``suffix``: ``-00001-of-00003``, or empty for one file), as ``save_pretrained`` names them."""
ADAPTER_FILES = "adapter_model{suffix}.safetensors"
"""A PEFT adapter's file, as ``PeftModel.save_pretrained`` names it (always one file: ``max_shard_size=None``)."""
INDEX_NAME = "model.safetensors.index.json"

Entries = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""``{name: (global shape, dtype)}`` of the tensors to write, in the order to write them."""


@dataclass
class WrittenWeights:
    """What ``write_weights`` wrote (on the writing process; empty elsewhere)."""

    files: list[str] = field(default_factory=list)
    """Files written, relative to the folder: the shards in plan order, then the index if there is one."""
    total_bytes: int = 0
    """Bytes of tensor data written."""
    largest_shard_bytes: int = 0
    """Tensor bytes of the largest file: about the writer's peak memory."""


def plan_shards(entries: Entries, max_shard_size: int | str | None, filename_pattern: str = MODEL_FILES):
    """huggingface_hub's ``StateDictSplit`` for tensors known only by shape and dtype (``meta``: nothing allocated).

    ``max_shard_size``: bytes, or a string such as ``"2GB"``; a tensor larger than that gets a file of its own;
    ``None``: one file, whatever its size.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in entries.items()}
    if max_shard_size is None:
        max_shard_size = max(1, sum(t.numel() * t.element_size() for t in meta.values()))
    return split_torch_state_dict_into_shards(meta, filename_pattern=filename_pattern, max_shard_size=max_shard_size)


def write_weights(
    directory: str | os.PathLike,
    entries: Entries,
    produce: Callable[[list[str]], dict[str, torch.Tensor] | None],
    *,
    max_shard_size: int | str | None,
    filename_pattern: str = MODEL_FILES,
    is_main: bool = True,
) -> WrittenWeights:
    """Write the tensors ``entries`` names into ``directory`` (which must exist on the writing process).

    ``produce(names)`` is called once per output file, in plan order, on every process that calls this (the plan
    depends on ``entries`` alone, so processes that call it with the same ``entries`` agree on it, and ``produce``
    may be collective); it returns the whole tensors on the process with ``is_main`` (ignored elsewhere). Only that
    process writes the files and, when there are several, their index (``model.safetensors.index.json``).
    ``max_shard_size`` and ``filename_pattern``: as ``plan_shards``'s.
    """
    plan = plan_shards(entries, max_shard_size, filename_pattern)
    written = WrittenWeights()
    for filename, names in plan.filename_to_tensors.items():
        tensors = produce(list(names))
        if is_main:
            tensors = {name: t.contiguous() for name, t in tensors.items()}
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            save_safetensors(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
            written.files.append(filename)
            written.total_bytes += nbytes
            written.largest_shard_bytes = max(written.largest_shard_bytes, nbytes)
        del tensors
    if is_main and plan.is_sharded:
        metadata = {**plan.metadata, "total_size": written.total_bytes}
        index = {"metadata": metadata, "weight_map": plan.tensor_to_filename}
        index_name = filename_pattern.format(suffix="") + ".index.json"  # huggingface_hub's naming
        with open(os.path.join(directory, index_name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.files.append(index_name)
    return written

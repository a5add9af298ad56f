"""Fill a model tensor that transformers assembles from several checkpoint tensors (per-expert MoE weights).

``fill_assembled`` reads the tensor's source checkpoint tensors whole, lets a copy of transformers' own
``WeightConverter`` build the model tensor (``add_tensor`` then ``convert``, the calls its loader
``convert_and_load_state_dict_in_model`` makes), copies this rank's block into the local shard and drops the
rest. A rank thus holds at most one assembled tensor (and its sources) at a time, never the whole model.

Not for: deciding names and converters (``key_map.py``) or walking the model (``stream.py``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_dist.loading.checkpoint_files import CheckpointFiles
from hf_dist.loading.key_map import Assembly
from hf_dist.loading.slices import local_blocks, local_tensor
from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR


def assemble(name: str, assembly: Assembly, files: CheckpointFiles, config=None) -> tuple[torch.Tensor, int]:
    """The whole model tensor ``name``, built by transformers' converter from its checkpoint tensors, and the
    bytes read."""
    converter = copy.deepcopy(assembly.converter)  # transformers gives each target its own converter too
    read = [0]

    def reader(key: str):
        def read_whole() -> torch.Tensor:  # called by the converter (its sync-loading path)
            part = files.read(key, ())
            read[0] += part.numel() * part.element_size()
            return part

        return read_whole

    for key, pattern in assembly.sources:
        converter.add_tensor(name, key, pattern, reader(key))
    built = converter.convert(name, config=config)
    if name not in built or len(built) != 1:
        raise ValueError(
            f"transformers' converter {assembly.converter!r} built {sorted(built)} for {name!r} from "
            f"{[key for key, _ in assembly.sources][:4]}...; load this checkpoint with transformers' from_pretrained"
        )
    return built[name], read[0]


def fill_assembled(
    tensor: torch.Tensor, module: nn.Module, name: str, assembly: Assembly, files: CheckpointFiles, config=None
) -> int:
    """Copy this rank's block of the assembled tensor ``name`` into ``tensor``; return the bytes read."""
    whole, read = assemble(name, assembly, files, config)
    if tuple(whole.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{name!r} assembled from the checkpoint in {files.directory!r} has shape {tuple(whole.shape)} but the "
            f"model's is {tuple(tensor.shape)}; the config does not match the checkpoint (check the config overrides "
            f"passed to from_pretrained)"
        )
    target = local_tensor(tensor)
    for local_index, source_index in local_blocks(tensor, getattr(module, FUSED_PARTS_ATTR, None)):
        target[local_index].copy_(whole[source_index])
    return read

"""The safetensors files of an HF checkpoint directory, read one slice at a time.

``CheckpointFiles`` maps every tensor name to its file (``model.safetensors.index.json`` or the single
``model.safetensors``) and reads a block of rows/columns of one tensor with ``safe_open(...).get_slice``, so a
rank touches only the bytes it keeps. A file is opened per read and closed right after: the memory-mapped pages
of a file stay in the process's resident set while it is open, and a column slice touches every page of its
tensor, so keeping files open would grow a rank's memory towards the whole checkpoint.

Not for: deciding which slice a rank owns (``slices.py``) or writing checkpoints (``save.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFiles:
    """Tensor name -> file, shape and dtype for the safetensors checkpoint in ``directory``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(self.directory, SINGLE_FILE)):
            weight_map = None
        else:
            present = sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []
            raise ValueError(
                f"{self.directory!r} has no {SINGLE_FILE} or {INDEX_FILE} (found {present[:8]}); the streaming "
                f"load reads safetensors only: re-save the model with save_pretrained(..., safe_serialization=True)"
            )
        self.file_of: dict[str, str] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        for name in files:
            with safe_open(os.path.join(self.directory, name), framework="pt") as handle:
                for key in handle.keys():
                    self.file_of[key] = name
                    self.shape_of[key] = tuple(handle.get_slice(key).get_shape())

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def keys(self) -> list[str]:
        return list(self.file_of)

    def read(self, key: str, index: Sequence[slice]) -> torch.Tensor:
        """``tensor[index]`` of checkpoint tensor ``key`` (one slice per leading dimension), in its stored dtype."""
        from safetensors import safe_open

        with safe_open(os.path.join(self.directory, self.file_of[key]), framework="pt") as handle:
            part = handle.get_slice(key)
            if not index:
                return part[:]
            return part[tuple(index)]

"""Reading checkpoints without unpickling arbitrary objects, and the per-rank RNG files.

DCP's stock reader unpickles ``.metadata`` with plain ``pickle`` and its default load planner reads non-tensor
entries with ``torch.load(weights_only=False)``: a crafted checkpoint could run code. ``SafeFileSystemReader``
unpickles the metadata with an allow-list of DCP's own metadata classes, and ``SafeLoadPlanner`` reads
non-tensor entries with ``weights_only=True``. RNG states go to safetensors (tensors + string metadata).

Not here: deciding what to save (``hf_dist.checkpoint.api``).
"""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element

from hf_dist.checkpoint.blocks import BlockLoadPlanner
from hf_dist.file_modes import save_safetensors

_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle, source: str):
        super().__init__(handle)
        self._source = source

    def find_class(self, module: str, name: str):
        if module in _DCP_METADATA_MODULES and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{self._source} references {module}.{name}, which is not DCP checkpoint metadata; refusing to load it"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled through an allow-list of DCP metadata classes."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = Path(self._get_metadata_path(rank))
        if not path.is_file():
            raise FileNotFoundError(f"DCP metadata file {path} is missing: the checkpoint is incomplete")
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, str(path)).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(BlockLoadPlanner):
    """DCP's load planner (multi-block DTensors read block by block: ``blocks``) that reads non-tensor entries
    with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# -- per-rank RNG ---------------------------------------------------------------------------------------------


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Python, NumPy, torch (and CUDA) generator states as safetensors tensors + string metadata."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{index}"] = state
    meta = {
        "python_version": str(py_version),
        "python_gauss": repr(py_gauss),
        "numpy_name": np_name,
        "numpy_pos": str(np_pos),
        "numpy_has_gauss": str(np_has_gauss),
        "numpy_gauss": repr(float(np_gauss)),
    }
    return tensors, meta


def save_rng(path: Path) -> None:
    tensors, meta = capture_rng()
    save_safetensors(tensors, path, metadata=meta)


def restore_rng(path: Path) -> None:
    """Restore the generators saved by ``save_rng`` (CUDA states only when this process has the same GPUs)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    gauss = None if meta["python_gauss"] == "None" else float(meta["python_gauss"])
    random.setstate((int(meta["python_version"]), tuple(int(v) for v in tensors["python"].tolist()), gauss))
    np.random.set_state(
        (
            meta["numpy_name"],
            tensors["numpy"].numpy().astype(np.uint32),
            int(meta["numpy_pos"]),
            int(meta["numpy_has_gauss"]),
            float(meta["numpy_gauss"]),
        )
    )
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[key] for key in sorted(k for k in tensors if k.startswith("cuda_"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)

"""``checkpoint_kind(path)``: the one answer to "what wrote this folder?", for resume, export and retention alike.

The kinds, decided in this order (the first that fits wins):

- ``"hf_dist"``: an hf_dist checkpoint (``manifest.json``; complete or not, ``manifest.is_complete`` says which),
  whatever else it holds (DistTrainer puts the Trainer's ``trainer_state.json`` in it too);
- ``"trainer_native"``: a checkpoint the Trainer wrote itself (DDP, DeepSpeed, one process: ``trainer_state.json``)
  whose model weights are ``save_pretrained`` output, or a PEFT adapter;
- ``"trainer_zero"``: a Trainer checkpoint whose model weights exist only as DeepSpeed ZeRO partitions;
- ``"model_dir"``: ``save_pretrained`` output alone (``config.json`` + ``model.safetensors`` or its index);
- ``"zero"``: a DeepSpeed checkpoint folder alone (a ``global_step*`` tag folder with ZeRO model-state files);
- ``None``: none of these (a missing path, a run folder, a file).

Not here: whether a checkpoint is complete (``manifest``), or which one of a run to resume (``hf_dist.trainer.resume``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from hf_dist.checkpoint.manifest import MANIFEST_NAME

CheckpointKind = Literal["hf_dist", "trainer_native", "trainer_zero", "model_dir", "zero"]
TRAINER_KINDS: frozenset[str] = frozenset({"trainer_native", "trainer_zero"})
"""The kinds the Trainer wrote itself: they resume only into the kind of run that wrote them."""

TRAINER_STATE = "trainer_state.json"
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def checkpoint_kind(path: str | Path | None) -> CheckpointKind | None:
    """What wrote the folder ``path`` (see the module docstring), or None when it is no checkpoint hf_dist knows."""
    if path is None or not Path(path).is_dir():
        return None
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return "hf_dist"
    model_dir = (path / "config.json").is_file() and any((path / name).is_file() for name in MODEL_WEIGHTS)
    zero = not model_dir and any(path.glob("global_step*/*model_states.pt"))
    if (path / TRAINER_STATE).is_file():
        return "trainer_zero" if zero else "trainer_native"
    if model_dir:
        return "model_dir"
    return "zero" if zero else None

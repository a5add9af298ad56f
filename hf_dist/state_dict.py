"""Gather a parallelised model back into ordinary tensors in HF layout: the one full-state-dict gatherer.

``full_state_dict`` turns every DTensor (FSDP2 shards, TP shards, both) into a whole tensor and puts fused
projections that TP interleaved back in HF row order; every rank calls it (the gathers are collectives) and gets
the same dict -- for the whole model only where that is small (tests), or for the few keys a PEFT adapter saves
(``peft_saved_keys``). ``save_gathered`` decides what the final save of a non-pipeline layout writes: a PEFT
adapter's tensors, or the whole model streamed. The final save of a whole model never gathers it: ``write_streaming``
fetches one whole tensor at a time into the current output file of hf_dist's Hub writer (``hf_dist.hub_writer``:
shards planned by huggingface_hub from the global shapes first, so names and index are exact), so rank 0 holds one
file plus one tensor. ``save_streaming`` feeds it from a model every rank holds a shard of; the pipeline's saver
(``pipeline_parallel.save``) from the stage that owns each tensor. ``gather_meter`` counts the whole tensors a
rank holds, to check that bound.

Not for: sharded checkpoints for resuming (``hf_dist.checkpoint``, DCP).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_dist.file_modes import give_user_mode
from hf_dist.hub_writer import Entries, write_weights
from hf_dist.models.peft_utils import is_peft_model
from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR, deinterleave_parts

DEFAULT_SHARD_BYTES = 2**30


@dataclass
class GatherMeter:
    """Whole (gathered) tensors alive on this rank while it is active: now and at the most."""

    live_bytes: int = 0
    peak_bytes: int = 0
    live_tensors: int = 0
    peak_tensors: int = 0

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.live_tensors += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_tensors = max(self.peak_tensors, self.live_tensors)

    def _drop(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self.live_tensors -= 1


_METERS: list[GatherMeter] = []


@contextlib.contextmanager
def gather_meter() -> Iterator[GatherMeter]:
    """Count, on this rank, the whole tensors the gatherer produces or receives until each is freed."""
    meter = GatherMeter()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


def held(value: torch.Tensor) -> torch.Tensor:
    """``value`` counted by the active meters until it is garbage (returns it unchanged)."""
    nbytes = value.numel() * value.element_size()
    for meter in _METERS:
        meter._add(nbytes)
        weakref.finalize(value, meter._drop, nbytes)
    return value


def fused_keys(model: nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    keys = {}
    for name, module in model.named_modules():
        fused = getattr(module, FUSED_PARTS_ATTR, None)
        if fused is None:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            keys[f"{name}.{param_name}" if name else param_name] = fused
    return keys


def _whole(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value
    mesh_device = value.device_mesh.device_type
    if value.device.type != mesh_device:  # FSDP CPU offload: shards on CPU, collectives on the mesh's device
        value = value.to(mesh_device)
    return value.full_tensor()


def hf_layout(key: str, value: torch.Tensor, fused: dict) -> torch.Tensor:
    """One state-dict entry whole and in HF row order (collective when it is a DTensor); ``fused`` is
    ``fused_keys(model)``."""
    gathered = isinstance(value, DTensor)
    value = _whole(value)
    if key in fused:
        parts, tp = fused[key]
        value = deinterleave_parts(value, parts, tp)
    return held(value.detach()) if gathered else value.detach()


def full_state_dict(
    model: nn.Module, *, cpu: bool = True, trainable_only: bool = False, keys: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()`` whole, in HF layout (collective over the model's meshes).

    ``cpu``: return CPU copies (never views of live parameters). ``trainable_only``: only parameters that
    require grad (a LoRA adapter), buffers and frozen weights left out. ``keys``: only these entries.
    """
    fused = fused_keys(model)
    keep = {name for name, p in model.named_parameters() if p.requires_grad} if trainable_only else None
    wanted = None if keys is None else set(keys)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if (keep is not None and key not in keep) or (wanted is not None and key not in wanted):
            continue
        value = hf_layout(key, value, fused)
        out[key] = held(value.to("cpu", copy=True)) if cpu else value
    return out


def peft_saved_keys(model: nn.Module) -> list[str]:
    """The ``model.state_dict()`` keys that ``PeftModel.save_pretrained`` writes (every adapter), found without
    gathering anything: PEFT's own selection runs on meta stand-ins and is traced back by identity.
    Raises ``ValueError`` for a PEFT method whose selection computes new tensors."""
    from peft import get_peft_model_state_dict

    stand_ins = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model.state_dict().items()}
    key_of = {id(v): k for k, v in stand_ins.items()}
    keys: list[str] = []
    for name in model.peft_config:
        selected = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=name)
        unknown = [k for k, v in selected.items() if id(v) not in key_of]
        if unknown:
            raise ValueError(
                f"the PEFT adapter {name!r} saves computed tensors {unknown[:3]}, not state-dict entries; hf_dist "
                f"cannot gather only those: save with trainer.save_model on a model hf_dist did not lay out"
            )
        keys += [key_of[id(v)] for v in selected.values() if key_of[id(v)] not in keys]
    return keys


def save_gathered(model: nn.Module, save_directory: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write ``model`` (an HF model or a ``PeftModel``, parallelised or not) as a normal directory from rank 0,
    never gathering more than the output needs (``DistTrainer._save`` uses it; under PP, ``pipeline_parallel.save``).

    A ``PeftModel`` writes its adapter only, and only the tensors PEFT saves are gathered (``peft_saved_keys``);
    an HF model writes all weights and its config through ``save_streaming`` (one file plus one tensor on
    rank 0). Every rank must call this (the gathers are collective); it returns after a barrier.
    """
    if not is_peft_model(model):
        return save_streaming(model, save_directory, max_shard_bytes=max_shard_bytes)
    state = full_state_dict(model, keys=peft_saved_keys(model))
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=state, is_main_process=True)
        give_user_mode(save_directory)  # safetensors leaves 0600
    if dist.is_initialized():
        dist.barrier()


def tied_sources(model: nn.Module) -> dict[str, str]:
    """``{tied key: source key}`` from the HF model's ``_tied_weights_keys`` when its config ties weights."""
    for module in model.modules():
        keys = getattr(type(module), "_tied_weights_keys", None)
        config = getattr(module, "config", None)
        if isinstance(keys, dict) and getattr(config, "tie_word_embeddings", False):
            return dict(keys)
    source = getattr(getattr(model, "pipeline", None), "source_model", None)
    return tied_sources(source) if source is not None and source is not model else {}


def save_streaming(model: nn.Module, save_directory: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write ``model``'s weights and config to ``save_directory`` from rank 0; every rank must call this.

    Tensors are written under the model's own checkpoint keys, as ``save_pretrained`` writes them: transformers'
    conversion mapping reversed (``revert_weight_conversion``), so MoE experts held as 3-D ``gate_up_proj`` /
    ``down_proj`` are stored per expert (``experts.N.gate_proj.weight``, Mixtral's ``block_sparse_moe...w1``)."""
    state = model.state_dict()
    tied = tied_sources(model)
    state = {k: v for k, v in state.items() if not (k in tied and tied[k] in state)}  # as save_pretrained drops them
    fused = fused_keys(model)
    stored = {k: _stored(model, {k: torch.empty(v.shape, dtype=v.dtype, device="meta")}) for k, v in state.items()}
    entries = {name: (tuple(t.shape), t.dtype) for parts in stored.values() for name, t in parts.items()}
    source = {name: key for key, parts in stored.items() for name in parts}
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    pending: dict[str, torch.Tensor] = {}

    def fetch(name: str) -> torch.Tensor | None:
        if name not in pending:  # the first stored tensor of a model tensor: gather it (collective), convert
            key = source[name]
            pending.update(_stored(model, {key: hf_layout(key, state[key], fused)}))
        value = pending.pop(name)
        return value if is_main else None

    write_streaming(model, save_directory, entries, fetch, max_shard_bytes=max_shard_bytes)


def _stored(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` under the model's checkpoint keys (transformers' conversion reversed); on meta it plans."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def write_streaming(
    model: nn.Module,
    save_directory: str,
    entries: Entries,
    fetch: Callable[[str], torch.Tensor | None],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write the tensors ``entries`` names (with their global shapes) and ``model``'s config as one HF directory
    from rank 0, through hf_dist's Hub writer (``hf_dist.hub_writer``). Every rank calls it with the same ``entries``
    and so calls ``fetch(key)`` for the same keys in the same (plan) order; ``fetch`` returns the whole tensor on
    rank 0 (None elsewhere), one at a time. Ends with a barrier."""
    is_main = not dist.is_initialized() or dist.get_rank() == 0

    def produce(keys: list[str]) -> dict[str, torch.Tensor]:
        part: dict[str, torch.Tensor] = {}
        for key in keys:
            value = fetch(key)
            if is_main:
                part[key] = held(value.detach().to("cpu").contiguous())  # counted once more if it is a copy
            del value
        return part

    if is_main:
        os.makedirs(save_directory, exist_ok=True)
    write_weights(save_directory, entries, produce, max_shard_size=max_shard_bytes, is_main=is_main)
    if is_main:
        _write_config(model, save_directory)
    if dist.is_initialized():
        dist.barrier()


def _hf_class(model: nn.Module) -> type:
    from transformers import PreTrainedModel

    return next(c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP"))


def _write_config(model: nn.Module, directory: str) -> None:
    model.config.architectures = [_hf_class(model).__name__]  # not FSDP2's FSDP<Class> wrapper class
    model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(directory)

"""Fill a laid-out model, built on ``meta``, from an HF safetensors checkpoint: each rank reads its own slices.

``stream_weights(model, directory)`` does not care which function laid the model out. It takes a model whose
parameters are DTensors (FSDP2, TP, both) or plain tensors (pipeline stages, replicated ones), some or all on
``meta``, gives the ``meta`` ones storage (``nn.Module.to_empty`` semantics, through FSDP2's own ``_apply`` so
its padded shards stay consistent), and copies into every local shard the block of the HF tensor it holds, cast
to the parameter's dtype. Tensors that already hold values (non-persistent buffers such as rotary ``inv_freq``
computed by the model's own ``__init__``, LoRA adapters initialised by PEFT) keep them; a ``meta`` tensor with
no checkpoint entry is an error (no silent random weights), as are shape mismatches. Tied weights are one
Parameter, filled once; where a rank holds only the tied alias (the last pipeline stage's lm_head) the
model's ``_tied_weights_keys`` name its source. A tensor transformers assembles from several checkpoint tensors
(``KeyMap.assembled``) is built by transformers' converter one tensor at a time (``assembly.py``).

Not for: building the model (``meta.py``), applying the layout (``hf_dist.trainer``), or saving (``hf_dist.state_dict``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dist.loading.assembly import fill_assembled
from hf_dist.loading.checkpoint_files import CheckpointFiles
from hf_dist.loading.key_map import KeyMap, identity_map
from hf_dist.loading.slices import checkpoint_key, local_blocks, local_tensor
from hf_dist.state_dict import tied_sources
from hf_dist.tensor_parallel.styles import FUSED_PARTS_ATTR

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LoadReport:
    """What ``stream_weights`` did, in ``from_pretrained``'s terms."""

    loaded: list[str] = field(default_factory=list)
    """Checkpoint keys copied into this rank's tensors."""
    kept: list[str] = field(default_factory=list)
    """Tensors of the model that were not on ``meta`` and kept their values (buffers, adapters)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint keys no tensor of the whole model uses (reported on every rank the same way)."""
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint."""


def module_roots(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``_apply`` must run to re-register FSDP2 shards: a pipeline's stage modules, else the model."""
    pipeline = getattr(model, "pipeline", None)
    stages = getattr(pipeline, "modules", None)
    return list(stages) if isinstance(stages, list) else [model]


def _named_tensors(roots: list[nn.Module]) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(fqn, owning module, attribute, tensor)`` for every parameter and buffer, each tensor once."""
    seen: set[int] = set()
    out = []
    for root in roots:
        for module_name, module in root.named_modules(remove_duplicate=False):
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    if tensor is None or id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    fqn = f"{module_name}.{name}" if module_name else name
                    out.append((fqn, module, name, tensor))
    return out


def _shared_parameters(roots: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """Groups of ``(module, name)`` slots holding one Parameter (tied weights), two slots or more."""
    groups: dict[int, dict[tuple[int, str], tuple[nn.Module, str]]] = {}
    for root in roots:
        for module in root.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    groups.setdefault(id(param), {})[(id(module), name)] = (module, name)
    return [list(g.values()) for g in groups.values() if len(g) > 1]


def materialize(model: nn.Module, device: torch.device | str) -> set[str]:
    """Give every ``meta`` parameter and buffer empty storage on ``device``; return their names.

    ``_apply`` gives each slot of a tied Parameter its own new tensor; the ties are restored afterwards.
    """
    roots = module_roots(model)
    pending = {fqn for fqn, _, _, tensor in _named_tensors(roots) if tensor.is_meta}
    tied = _shared_parameters(roots)

    def empty_if_meta(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor

    with torch.no_grad():
        for root in roots:
            root._apply(empty_if_meta)  # FSDP2 modules re-pad and re-register their shards in their _apply
    for (first, first_name), *others in tied:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    return pending


def _resolve_key(fqn: str, names: KeyMap, tied: dict[str, str]) -> str | None:
    key = checkpoint_key(fqn)
    for candidate in (key, tied.get(key)):
        if candidate is not None and candidate in names.to_file:
            return names.to_file[candidate]
    return None


def _fill(tensor: torch.Tensor, module: nn.Module, key: str, files: CheckpointFiles) -> int:
    expected = files.shape_of[key]
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"checkpoint tensor {key!r} has shape {expected} but the model's is {tuple(tensor.shape)}; the config "
            f"does not match the checkpoint in {files.directory!r} (check the config overrides passed to from_pretrained)"
        )
    target = local_tensor(tensor)
    fused = getattr(module, FUSED_PARTS_ATTR, None)
    read = 0
    for local_index, source_index in local_blocks(tensor, fused):
        block = files.read(key, source_index)
        target[local_index].copy_(block)
        read += block.numel() * block.element_size()
    return read


def _load_one(
    fqn: str, module: nn.Module, tensor: torch.Tensor, is_pending: bool, names: KeyMap, tied: dict[str, str],
    files: CheckpointFiles, report: LoadReport, model: nn.Module,
) -> bool:
    """Fill one tensor (read as stored, or assembled by transformers' converter); False when nothing names it."""
    key = _resolve_key(fqn, names, tied)
    assembly = names.assembled.get(checkpoint_key(fqn))
    sources = [source for source, _ in assembly.sources] if assembly is not None else []
    if not is_pending:
        report.kept.append(fqn)
        report.loaded.extend(([key] if key is not None else []) + sources)  # it holds its value; keys are used
        return True
    if assembly is not None:
        config = getattr(model, "config", None)
        report.bytes_read += fill_assembled(tensor, module, checkpoint_key(fqn), assembly, files, config)
        report.loaded.extend(sources)
        return True
    if key is None:
        return False
    report.bytes_read += _fill(tensor, module, key, files)
    report.loaded.append(key)
    return True


def stream_weights(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    strict: bool = True,
    names: KeyMap | None = None,
) -> LoadReport:
    """Materialise ``model``'s ``meta`` tensors on ``device`` and fill every rank's shards from ``directory``.

    ``strict``: a ``meta`` tensor the checkpoint lacks is a ``ValueError`` (it would otherwise keep garbage).
    Unexpected checkpoint keys are logged as ``from_pretrained`` does. ``names``: which checkpoint tensor fills
    which model tensor (``key_map.key_map`` of the unlaid model; default: the same names). Collective only where
    FSDP2 is (its ``_apply`` resharding); the reads themselves are local.
    """
    files = CheckpointFiles(directory)
    names = names if names is not None else identity_map(files.keys())
    pending = materialize(model, device)
    tied = tied_sources(model)
    report = LoadReport()
    missing = []
    with torch.no_grad():
        for fqn, module, _, tensor in _named_tensors(module_roots(model)):
            if not _load_one(fqn, module, tensor, fqn in pending, names, tied, files, report, model):
                missing.append(fqn)
    if missing and strict:
        raise ValueError(
            f"{len(missing)} tensors of the model are not in the checkpoint {files.directory!r}: {missing[:6]}; "
            f"the checkpoint does not match the architecture (load with transformers' from_pretrained to have "
            f"them initialised randomly, or pass the matching config)"
        )
    report.unexpected = _unexpected(model, files, set(report.loaded), tied, names)
    if report.unexpected:
        logger.warning("Some weights of the checkpoint were not used: %s", report.unexpected[:20])
    return report


def _unexpected(
    model: nn.Module, files: CheckpointFiles, used: set[str], tied: dict[str, str], names: KeyMap
) -> list[str]:
    """Checkpoint keys no rank uses. Under PP a rank holds few keys: compare with every rank's names."""
    import torch.distributed as dist

    seen = set(used)
    if dist.is_available() and dist.is_initialized() and module_roots(model)[0] is not model:
        gathered: list[set[str]] = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, seen)
        seen = set().union(*gathered)
    for alias, source in tied.items():  # a tied pair uses both of its checkpoint entries
        pair = {names.to_file.get(alias), names.to_file.get(source)} - {None}
        if pair & seen:
            seen |= pair
    return sorted(k for k in files.keys() if k not in seen)

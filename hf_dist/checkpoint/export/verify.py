"""Check an exported Hub folder with memory bounded by about one tensor: structure on ``meta``, then values.

``verify="tensors"`` (the default of every exporter) runs two checks, neither of which holds a model:

1. Structure: the model of the exported ``config.json`` is built on ``meta`` (no storage), and the exported
   safetensors keys and shapes must be exactly what ``from_pretrained`` fills, by transformers' own renaming rules
   (``hf_dist.loading.key_map``); a tied alias (``lm_head.weight`` with ``tie_word_embeddings``) may be absent, as
   ``from_pretrained`` re-ties it. A missing, unexpected or mis-shaped tensor is a ``CheckpointError`` naming it.
2. Values: every exported tensor is read alone (``safe_open``) and compared with the same tensor read alone from
   the source (the caller's ``expected(name)``): same dtype, same shape, equal values.

So the peak is one exported tensor + one source tensor (+ what the source reader holds). Where transformers
assembles model tensors from several stored ones (per-expert MoE folders), ``verify_same_files`` compares the
stored tensors of the export with those of a source that ``from_pretrained`` has already loaded cleanly. ``verify="logits"``
keeps the older end-to-end check (the checkpoint loaded as a model and the export loaded with
``from_pretrained``, logits compared on a probe batch): it needs about twice the model in host RAM.

Not here: writing the export (the ``export`` package, ``zero``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from hf_dist.checkpoint import manifest as mf

VerifyMode = Literal["tensors", "logits", "none"]
VERIFY_MODES: tuple[str, ...] = ("tensors", "logits", "none")


class AssembledError(mf.CheckpointError):
    """Transformers builds some model tensors from several stored ones: no one-to-one tensor comparison."""


def verify_mode(verify: bool | str) -> str:
    """``True`` -> ``'tensors'``, ``False`` -> ``'none'``; a string must be one of ``VERIFY_MODES``."""
    if verify is True:
        return "tensors"
    if verify is False:
        return "none"
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r} is not a verification; use one of {list(VERIFY_MODES)} "
                         f"('tensors': bounded memory, the default; 'logits': ~2x the model in host RAM)")
    return verify


def meta_model(config_dir: Path):
    """The causal LM of ``config_dir/config.json`` on ``meta``, tied weights tied, as ``from_pretrained`` builds it."""
    from transformers import AutoConfig

    from hf_dist.loading.meta import build_on_meta

    config = AutoConfig.from_pretrained(str(config_dir))
    return build_on_meta(config, torch.float32, {})


def model_names(model: torch.nn.Module, file_keys: list[str], where: str) -> dict[str, str]:
    """Model tensor name -> file key for every file key; ``CheckpointError`` for keys no model tensor takes."""
    from hf_dist.loading.key_map import key_map

    names = key_map(model, file_keys)
    if names.assembled or names.unsupported:
        described = names.describe_assembly() or names.describe_assembly(unsupported=True)
        raise AssembledError(f"{where}: tensors {described} are converted by transformers from other stored "
                             f"tensors; check this folder with verify='logits' (--verify logits)")
    unexpected = sorted(set(file_keys) - set(names.to_file.values()))
    if unexpected:
        raise mf.CheckpointError(f"{where}: tensors {unexpected[:6]} are not parameters of the "
                                 f"{type(model).__name__} its config.json describes (from_pretrained would drop them)")
    return names.to_file


def check_structure(out: Path, what: str = "export"):
    """``(files, model name -> file key, tied alias -> source)`` after checking that folder ``out`` holds exactly
    what ``from_pretrained`` fills (``what`` names the folder in errors)."""
    from hf_dist.loading.checkpoint_files import CheckpointFiles
    from hf_dist.state_dict import tied_sources

    files = CheckpointFiles(out)
    model = meta_model(out)
    to_file = model_names(model, files.keys(), f"{what} {out}")
    tied = tied_sources(model)
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [n for n in wanted if n not in to_file and not (n in tied and tied[n] in to_file)]
    if missing:
        raise mf.CheckpointError(f"{what} {out}: tensors {missing[:6]} of {type(model).__name__} are missing "
                                 f"({len(missing)} in all); from_pretrained would initialise them randomly")
    for name, key in to_file.items():
        if files.shape_of[key] != wanted[name]:
            raise mf.CheckpointError(f"{what} {out}: tensor {key} has shape {files.shape_of[key]} but the model's "
                                     f"{name} is {wanted[name]}")
    return files, to_file, tied


def exact(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """``None`` when equal (dtype, shape, every value), else what differs."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"is {got.dtype} {tuple(got.shape)}, the checkpoint's is {want.dtype} {tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    diff = (got.float() - want.float()).abs()
    return f"differs from the checkpoint: {int((diff > 0).sum())} values, max |diff| {diff.max().item():.3g}"


def verify_tensors(
    out: Path,
    expected: Callable[[str], torch.Tensor],
    expected_names: set[str],
) -> int:
    """Structure of ``out``, then every exported tensor against ``expected(model name)``; the count checked.

    ``expected_names``: the model names the source holds (its tied alias dropped); the export must hold exactly these.
    """
    files, to_file, _ = check_structure(out)
    absent = sorted(expected_names - set(to_file))
    extra = sorted(set(to_file) - expected_names)
    if absent or extra:
        raise mf.CheckpointError(f"export {out}: tensors {absent[:6]} of the checkpoint are not in it, "
                                 f"tensors {extra[:6]} are not in the checkpoint")
    for name, key in sorted(to_file.items()):
        problem = exact(name, files.read(key, ()), expected(name))
        if problem is not None:
            raise mf.CheckpointError(f"export {out}: tensor {key} (in {files.file_of[key]}) {problem}")
    return len(to_file)


def stored_tensors(model_dir: Path):
    """``(files, model name -> file key)`` of a ``save_pretrained`` folder after ``check_structure``, a tied alias
    stored next to its source left out (``save_pretrained`` writes a tied pair once)."""
    files, to_file, tied = check_structure(model_dir, "checkpoint")
    for alias, source in tied.items():
        if alias in to_file and source in to_file:
            del to_file[alias]
    return files, to_file


def source_tensors(model_dir: Path) -> tuple[Callable[[str], torch.Tensor], set[str]]:
    """For a ``save_pretrained`` folder: ``(read one tensor by model name, the model names it holds)``."""
    files, to_file = stored_tensors(model_dir)
    return (lambda name: files.read(to_file[name], ())), set(to_file)


def verify_same_files(out: Path, source_dir: Path) -> int:
    """``out`` holds the same stored tensors as ``source_dir`` (a folder ``from_pretrained`` has loaded without a
    missing, unexpected or mis-shaped weight), each equal; the count. For folders whose tensors transformers
    assembles on load (per-expert MoE weights), where a tensor-by-model-name comparison does not exist."""
    from hf_dist.loading.checkpoint_files import CheckpointFiles

    got, want = CheckpointFiles(out), CheckpointFiles(source_dir)
    missing, extra = sorted(set(want.keys()) - set(got.keys())), sorted(set(got.keys()) - set(want.keys()))
    if missing or extra:
        raise mf.CheckpointError(f"export {out}: tensors {missing[:6]} of the checkpoint are not in it, "
                                 f"tensors {extra[:6]} are not in the checkpoint")
    for key in sorted(got.keys()):
        problem = exact(key, got.read(key, ()), want.read(key, ()))
        if problem is not None:
            raise mf.CheckpointError(f"export {out}: tensor {key} (in {got.file_of[key]}) {problem}")
    return len(got.keys())

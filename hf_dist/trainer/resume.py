"""Which checkpoint a run resumes from, and keeping an earlier run's checkpoints (and saved model) safe from a
fresh start.

``--resume_from_checkpoint`` (``DistTrainingArguments.resume_from_checkpoint`` or ``DistTrainer.train``'s
argument) takes:

- ``true``: the newest complete checkpoint in ``output_dir`` (an hf_dist checkpoint counts once its ``COMPLETE``
  marker matches, a Trainer-native one once its ``trainer_state.json`` is written); an error when there is none;
- ``auto``: the same, but a fresh start when there is none (one command line for the first start and every
  requeue or elastic restart);
- a path: that checkpoint, or the newest complete one under it when it is a run folder;
- ``false`` / unset: a fresh start, as the Trainer allows (a notebook cell run twice). ``checkpoint-N`` folders
  already in ``output_dir`` belong to an earlier run: before anything is saved, the main process moves them (and
  ``latest``) into ``output_dir/previous_run-<UTC time>/`` and says so once. The Trainer's ``checkpoint-*`` glob,
  its rotation and ``true`` never look there, so this run neither overwrites nor rotates them away, and they
  still resume by path. ``--overwrite_output_dir`` (hf_dist's flag; transformers 5 removed it) deletes them
  instead. A resume from a checkpoint outside ``output_dir`` treats ``output_dir``'s checkpoints the same way,
  and a resume from ``output_dir/checkpoint-N`` those of steps after N (an abandoned continuation: the new saves
  would replace them, and the Trainer's rotation keeps the highest step and deletes the new ones).

A model saved into a folder (``DistTrainer.save_model``, e.g. a recipe's ``final/``) meets an earlier save's files the
same way: its model files (weights, index, config; a PEFT adapter) are moved into ``folder/previous_run-<UTC time>/``
first (``move_earlier_model``), so a full model saved over an adapter (or an adapter over a full model) never reloads
mixed with the old one, and nothing written before is lost.

Errors for a checkpoint that is not there start with the Trainer's own wording and add what to do.

Not here: loading a checkpoint (``hf_dist.checkpoint``), the Trainer overrides that call this (``trainer``).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.export.folder import WEIGHT_PATTERNS
from hf_dist.checkpoint.kind import TRAINER_KINDS, checkpoint_kind

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_TRUE, _FALSE, AUTO = ("true", "yes", "1"), ("false", "no", "0", "none", ""), "auto"
PREVIOUS_RUN_PREFIX = "previous_run-"


def parse_resume(value: bool | str | None) -> bool | str | None:
    """``True``, ``"auto"``, a path, or ``None`` (fresh start) from a flag value or a ``train()`` argument."""
    if value is None or value is False:
        return None
    if value is True:
        return True
    text = str(value).strip()
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return None
    if text.lower() == AUTO:
        return AUTO
    return text


def existing_checkpoints(output_dir: str | Path) -> list[Path]:
    """Every ``checkpoint-N`` folder (complete or not) and the ``latest`` pointer in ``output_dir``."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)]
    if (root / mf.LATEST_NAME).is_file():
        found.append(root / mf.LATEST_NAME)
    return sorted(found)


def newest_checkpoint(root: str | Path, *, native_only: bool = False) -> Path | None:
    """The complete checkpoint of the highest step under ``root`` (hf_dist and Trainer-native alike)."""
    root = Path(root)
    candidates: list[tuple[int, Path]] = []
    if not native_only:
        candidates += [(mf.read_manifest(p).step, p) for p in mf.complete_checkpoints(root)]
    for path in existing_checkpoints(root):
        match = _CHECKPOINT_RE.match(path.name)
        if match and checkpoint_kind(path) in TRAINER_KINDS:
            candidates.append((int(match.group(1)), path))
    return max(candidates, key=lambda c: (c[0], c[1].name))[1] if candidates else None


def earlier_run_checkpoints(output_dir: str | Path, resume: bool | str | None) -> list[Path]:
    """The checkpoints (and ``latest``) in ``output_dir`` that a run with this ``resume`` does not continue.

    All of them on a fresh start, or when resuming from a checkpoint that lives elsewhere (another folder, or an
    earlier run's moved-aside ``previous_run-*``); those of later steps when resuming ``output_dir/checkpoint-N``
    (with ``latest`` if it names one of them); none with ``true``/``auto`` or ``output_dir`` itself.
    """
    resume = parse_resume(resume)
    if resume is True or resume == AUTO:
        return []
    root = Path(output_dir).resolve()
    found = existing_checkpoints(root)
    path = Path(resume).resolve() if resume is not None else None
    if path == root:
        return []
    if path is None or path.parent != root or not _CHECKPOINT_RE.match(path.name):
        return found
    later = [p for p in found if p.name != mf.LATEST_NAME and _step(p) > _step(path)]
    latest = root / mf.LATEST_NAME
    if latest.is_file() and latest.read_text(encoding="utf-8").strip() in {p.name for p in later}:
        later.append(latest)
    return later


def _step(checkpoint: Path) -> int:
    return int(_CHECKPOINT_RE.match(checkpoint.name).group(1))


def move_aside(output_dir: str | Path, checkpoints: list[Path]) -> Path:
    """Move ``checkpoints`` into a new ``output_dir/previous_run-<UTC time>`` (call on the main process only)."""
    root = Path(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest, n = root / f"{PREVIOUS_RUN_PREFIX}{stamp}", 1
    while dest.exists():  # two fresh starts within one second
        n += 1
        dest = root / f"{PREVIOUS_RUN_PREFIX}{stamp}-{n}"
    dest.mkdir()
    for path in checkpoints:
        path.rename(dest / path.name)
    return dest


# What a model save leaves that a loader picks up by name: transformers' weights, index and config, PEFT's adapter.
# transformers' from_pretrained loads an adapter_config.json it finds (over its base, not the folder's weights), so
# an adapter left beside a new full model's files would replace it; model.safetensors beside a new index wins too.
SAVED_MODEL_PATTERNS = (*WEIGHT_PATTERNS, "adapter_model.bin", "config.json", "generation_config.json")


def earlier_model_files(folder: str | Path) -> list[Path]:
    """The model files (full model or adapter, ``SAVED_MODEL_PATTERNS``) an earlier save left in ``folder``."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted({p for pattern in SAVED_MODEL_PATTERNS for p in root.glob(pattern) if p.is_file()})


def move_earlier_model(folder: str | Path) -> Path | None:
    """Before a model is saved into ``folder``: move an earlier save's model files into
    ``folder/previous_run-<UTC time>/`` (``move_aside``), so that the new save never loads mixed with them.
    Returns that folder, or None when there was nothing (call on the main process only)."""
    earlier = earlier_model_files(folder)
    return move_aside(folder, earlier) if earlier else None


def remove_checkpoints(checkpoints: list[Path]) -> None:
    """``--overwrite_output_dir``: delete an earlier run's checkpoints and ``latest`` (main process only)."""
    for path in checkpoints:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _moved_aside_hint(output_dir: str | Path) -> str:
    root = Path(output_dir)
    earlier = sorted(p.name for p in root.glob(f"{PREVIOUS_RUN_PREFIX}*") if p.is_dir()) if root.is_dir() else []
    if not earlier:
        return ""
    return f"; earlier runs' checkpoints were moved aside into {root}/{{{', '.join(earlier)}}}: pass one as the path"


def resolve_resume(resume: bool | str | None, output_dir: str | Path, *, native_only: bool) -> str | None:
    """The checkpoint folder to load, or None for a fresh start; ``ValueError`` naming the fix otherwise."""
    resume = parse_resume(resume)
    if resume is None:
        return None
    if resume is True or resume == AUTO:
        found = newest_checkpoint(output_dir, native_only=native_only)
        if found is None and resume is True:
            raise ValueError(  # the Trainer's wording first
                f"No valid checkpoint found in output directory ({output_dir}): resume_from_checkpoint=true needs a "
                f"complete checkpoint-N there; check --output_dir, pass a checkpoint path, or use "
                f"--resume_from_checkpoint auto to start fresh when there is none{_moved_aside_hint(output_dir)}"
            )
        return None if found is None else str(found)
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {resume}: resume_from_checkpoint={resume!r} is not a "
                         f"folder; pass a checkpoint-N folder, a run folder, or true{_moved_aside_hint(output_dir)}")
    if checkpoint_kind(path) in TRAINER_KINDS | {"hf_dist"}:
        return str(path)
    found = newest_checkpoint(path, native_only=native_only)
    if found is None:
        raise ValueError(f"Can't find a valid checkpoint at {resume}: it is neither a checkpoint (no "
                         f"{mf.MANIFEST_NAME} or {TRAINER_STATE}) nor a folder holding a complete one; pass a "
                         f"checkpoint-N folder")
    return str(found)


def set_aside(folder: Path) -> Path | None:
    """Before the Trainer writes ``folder``: move an existing one out of the way (by then only this run's own: a
    save that died before a restart, since ``keep_earlier_run`` set every other run's aside).

    The Trainer writes into an existing folder file by file, which would mix its files with an hf_dist
    checkpoint's (or leave a larger world's ``rng_state_N.pth`` behind). Returns the moved folder, to delete once
    the new save is written; ``latest`` is dropped when it named the old folder.
    """
    if not folder.exists():
        return None
    aside = folder.with_name(f".{folder.name}.replaced")
    if aside.exists():
        shutil.rmtree(aside)
    folder.rename(aside)
    latest = folder.parent / mf.LATEST_NAME
    if latest.is_file() and latest.read_text(encoding="utf-8").strip() == folder.name:
        latest.unlink()
    return aside


# -- DistTrainer glue (collective: every rank calls these at the same point) ---------------------------------
def prepare_resume(trainer, explicit: bool | str | None) -> str | None:
    """``DistTrainer.train``'s resume argument (else ``args.resume_from_checkpoint``) as a checkpoint folder."""
    args = trainer.args
    value = explicit if explicit is not None else args.resume_from_checkpoint
    path = resolve_resume(value, args.output_dir, native_only=trainer.is_deepspeed_enabled)  # before moving any
    keep_earlier_run(trainer, value)
    if path is not None and trainer.owns_layout and checkpoint_kind(path) in TRAINER_KINDS:
        raise ValueError(
            f"{path} was written by the Trainer itself (a DDP, DeepSpeed or one-process run); hf_dist loads it "
            f"only into that kind of run, not into a layout hf_dist applies (FSDP2/TP/PP); resume with the "
            f"layout that wrote it, or pass a checkpoint written under FSDP2/TP/PP"
        )
    if path is not None and args.should_log:  # one line a restart log can be read by (elastic, requeue)
        contract = args.batch_contract
        print(f"resuming from {path} with world size {contract.world_size}: global batch "
              f"{contract.global_batch_size} = {contract.micro_batch_size} x {contract.dp} x "
              f"{contract.gradient_accumulation_steps}", flush=True)
    return path


def keep_earlier_run(trainer, resume: bool | str | None) -> None:
    """Move (``--overwrite_output_dir``: delete) an earlier run's checkpoints out of ``output_dir`` before any save."""
    args = trainer.args
    earlier = earlier_run_checkpoints(args.output_dir, resume) if args.should_save else []
    if earlier and args.overwrite_output_dir:
        remove_checkpoints(earlier)
        print(f"hf_dist: --overwrite_output_dir: deleted the earlier run's {_names(earlier)} in {args.output_dir}",
              flush=True)
    elif earlier:
        dest = move_aside(args.output_dir, earlier)
        print(f"hf_dist: {args.output_dir} held an earlier run's {_names(earlier)}; moved them into {dest} so that "
              f"this run neither overwrites nor rotates them away (--resume_from_checkpoint {dest} resumes the "
              f"newest of them; --overwrite_output_dir deletes them instead)", flush=True)
    trainer.accelerator.wait_for_everyone()  # no rank saves, or looks for a checkpoint, before they are gone


def keep_earlier_model(trainer, folder: str | Path) -> None:
    """``DistTrainer.save_model``: an earlier save's model files in ``folder`` moved aside before this one writes."""
    dest = move_earlier_model(folder) if trainer.args.should_save else None
    if dest is not None:
        print(f"hf_dist: {folder} held an earlier save's {_names(sorted(dest.iterdir()))}; moved them into {dest} so "
              f"that the model saved now does not load mixed with them", flush=True)
    trainer.accelerator.wait_for_everyone()  # no rank writes before they are gone


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths[:4]) + (", ..." if len(paths) > 4 else "")


def save_native_checkpoint(trainer, model, trial, save) -> None:
    """The Trainer's own save (``save(model, trial)``) into a ``checkpoint-N`` that holds nothing else."""
    folder = Path(trainer._get_output_dir(trial=trial)) / f"checkpoint-{trainer.state.global_step}"
    aside = set_aside(folder) if trainer.args.should_save else None
    trainer.accelerator.wait_for_everyone()  # no rank writes before the old folder is out of the way
    save(model, trial)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)

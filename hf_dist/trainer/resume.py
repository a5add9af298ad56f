"""Which checkpoint a run resumes from, and the refusal to train over checkpoints nobody asked to resume.

``--resume_from_checkpoint`` (``DistTrainingArguments.resume_from_checkpoint`` or ``DistTrainer.train``'s
argument) takes:

- ``true``: the newest complete checkpoint in ``output_dir`` (an hf_dist checkpoint counts once its ``COMPLETE``
  marker matches, a Trainer-native one once its ``trainer_state.json`` is written); an error when there is none;
- ``auto``: the same, but a fresh start when there is none (one command line for the first start and every
  requeue or elastic restart);
- a path: that checkpoint, or the newest complete one under it when it is a run folder;
- ``false`` / unset: a fresh start, refused when ``output_dir`` already holds checkpoints unless
  ``--overwrite_output_dir`` is given (which then removes them, so that no later resume picks an old run's).

Not here: loading a checkpoint (``hf_dist.checkpoint``), the Trainer overrides that call this (``trainer``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.kind import TRAINER_KINDS, checkpoint_kind

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_TRUE, _FALSE, AUTO = ("true", "yes", "1"), ("false", "no", "0", "none", ""), "auto"


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


def check_output_dir(output_dir: str | Path, resume: bool | str | None, overwrite_output_dir: bool) -> None:
    """Refuse a fresh start into a folder holding checkpoints (pure check; call it before any process starts)."""
    if parse_resume(resume) is not None or overwrite_output_dir:
        return
    found = existing_checkpoints(output_dir)
    if found:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(
            f"output_dir {output_dir} already holds checkpoints ({names}) and resume_from_checkpoint is not set: "
            f"training would overwrite them; pass --resume_from_checkpoint true (or a checkpoint path) to continue "
            f"that run, --overwrite_output_dir to discard it, or choose another --output_dir"
        )


def remove_checkpoints(output_dir: str | Path) -> list[Path]:
    """``--overwrite_output_dir``: delete the previous run's checkpoints and ``latest`` (main process only)."""
    removed = existing_checkpoints(output_dir)
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


def resolve_resume(resume: bool | str | None, output_dir: str | Path, *, native_only: bool) -> str | None:
    """The checkpoint folder to load, or None for a fresh start; ``ValueError`` naming the fix otherwise."""
    resume = parse_resume(resume)
    if resume is None:
        return None
    if resume is True or resume == AUTO:
        found = newest_checkpoint(output_dir, native_only=native_only)
        if found is None and resume is True:
            raise ValueError(
                f"resume_from_checkpoint=true but output_dir {output_dir} holds no complete checkpoint; check "
                f"--output_dir, pass a checkpoint path, or use --resume_from_checkpoint auto to start fresh when "
                f"there is none"
            )
        return None if found is None else str(found)
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"resume_from_checkpoint={resume!r} is not a folder; pass a checkpoint-N folder, a run "
                         f"folder, or true")
    if checkpoint_kind(path) in TRAINER_KINDS | {"hf_dist"}:
        return str(path)
    found = newest_checkpoint(path, native_only=native_only)
    if found is None:
        raise ValueError(f"resume_from_checkpoint={resume!r} is neither a checkpoint (no {mf.MANIFEST_NAME} or "
                         f"{TRAINER_STATE}) nor a folder holding a complete one; pass a checkpoint-N folder")
    return str(found)


def set_aside(folder: Path) -> Path | None:
    """Before the Trainer writes ``folder``: move an existing one (another run, format or layout) out of the way.

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
    check_output_dir(args.output_dir, value, args.overwrite_output_dir)
    if parse_resume(value) is None and args.overwrite_output_dir:
        if args.should_save:
            remove_checkpoints(args.output_dir)
        trainer.accelerator.wait_for_everyone()
    path = resolve_resume(value, args.output_dir, native_only=trainer.is_deepspeed_enabled)
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


def save_native_checkpoint(trainer, model, trial, save) -> None:
    """The Trainer's own save (``save(model, trial)``) into a ``checkpoint-N`` that holds nothing else."""
    folder = Path(trainer._get_output_dir(trial=trial)) / f"checkpoint-{trainer.state.global_step}"
    aside = set_aside(folder) if trainer.args.should_save else None
    trainer.accelerator.wait_for_everyone()  # no rank writes before the old folder is out of the way
    save(model, trial)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)

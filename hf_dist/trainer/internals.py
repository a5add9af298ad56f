"""Every private member of transformers, accelerate or torch that hf_dist overrides, patches or sets -- and why.

An override of a method the base class stops calling fails silently (gradient sync or clipping just stops), so
each one is listed here with the reason and the public ``Trainer`` method that calls it. ``check_internals`` runs
when a ``DistTrainer`` is built and stops with the installed versions if one of them is gone, and warns once (main
process) when transformers, accelerate, torch, peft or trl is outside the tested range;
``tests/test_trainer_internals.py`` checks that each override is still *called*, in a real run, for the versions
in ``TESTED_VERSIONS`` (the bounds in ``setup.cfg`` and the README).

Not here: the overrides themselves (``trainer.py`` and the modules of ``hf_dist.trainer`` call what this lists).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

TESTED_VERSIONS: dict[str, tuple[str, str]] = {
    "transformers": (">=5.23", "<5.25"),
    "accelerate": (">=1.15", "<1.16"),
    "torch": (">=2.13", "<2.14"),
    "peft": (">=0.21", "<0.22"),
    "trl": (">=1.16", "<1.17"),
}
"""The one declaration of the ranges the whole suite was run on (docs/compatibility.md records the runs).
transformers and accelerate, whose private members hf_dist overrides, are required in exactly these ranges by
setup.cfg ``install_requires``; torch, peft and trl are only floored there (a ceiling would make pip downgrade a
newer install), so outside these ranges the start-up guard warns instead (``tests/test_trainer_internals.py``
checks setup.cfg and the README against this)."""


@dataclass(frozen=True, kw_only=True)
class PrivateMember:
    """One private member hf_dist depends on."""

    owner: str
    """Where it lives: ``"transformers.Trainer"``, ``"accelerate.Accelerator"``, ..."""
    name: str
    """The member's name."""
    kind: Literal["override", "patch", "set", "call"]
    """override: a DistTrainer method replacing the base one; patch: an instance attribute replaced; set: a flag
    or value written; call: a private function called."""
    where: str
    """The hf_dist module that touches it."""
    why: str
    """What would go wrong without it."""
    called_by: str = ""
    """For overrides: the Trainer method whose body calls it (checked by the tests)."""


_T, _A = "transformers.Trainer", "accelerate.Accelerator"
PRIVATE_MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember(owner=_T, name="_sync_replicated_trainable_parameters", kind="override", where="trainer.trainer",
                  called_by="_prepare_for_training",
                  why="under PP every rank holds different stages: broadcasting rank 0's parameters would overwrite them"),
    PrivateMember(owner="torch.nn.Parameter", name="_replicated_grad_hook_registered", kind="set",
                  where="trainer.trainer",
                  why="the Trainer's _sync_replicated_trainable_parameters registers an all-reduce hook on every plain "
                      "parameter unless marked: hf_dist reduces gradients itself, the hooks reduced them twice"),
    PrivateMember(owner=_T, name="_clip_grad_norm", kind="override", where="trainer.trainer",
                  called_by="_run_epoch",
                  why="under PP the gradient norm spans every stage's rank, not only this rank's parameters"),
    PrivateMember(owner=_T, name="_defer_fsdp_gradient_reduction", kind="override", where="trainer.trainer",
                  called_by="_run_epoch",
                  why="gradient accumulation on hf_dist's FSDP2 model: reduce once per optimizer step (HSDP: skip the "
                      "all-reduce, not only the reduce-scatter)"),
    PrivateMember(owner=_T, name="_prepare_context_parallel_inputs", kind="override", where="trainer.context",
                  called_by="training_step",
                  why="under CP each rank keeps its slice of the shifted labels and runs the step inside the "
                      "sequence split; without it every cp rank would train on whole sequences with a 1/cp loss"),
    PrivateMember(owner=_T, name="_get_num_items_in_batch", kind="override", where="trainer.loss",
                  called_by="get_batch_samples",
                  why="with average_tokens_across_devices=False the Trainer still divides this rank's own token count "
                      "by tp, as if it had been gathered over the tp ranks: every TP loss and gradient came out tp "
                      "times too large"),
    PrivateMember(owner=_T, name="_save_checkpoint", kind="override", where="trainer.checkpoint_glue",
                  called_by="_maybe_log_save_evaluate",
                  why="FSDP2/TP/PP models are checkpointed sharded and atomically by hf_dist.checkpoint"),
    PrivateMember(owner=_T, name="_load_from_checkpoint", kind="override", where="trainer.checkpoint_glue",
                  called_by="_prepare_for_training",
                  why="an hf_dist checkpoint holds DCP shards, not a model file the Trainer can read"),
    PrivateMember(owner=_T, name="_load_optimizer_and_scheduler", kind="override", where="trainer.checkpoint_glue",
                  called_by="_prepare_for_training",
                  why="model and optimizer load together from DCP, resharded to this run's layout"),
    PrivateMember(owner=_T, name="_load_rng_state", kind="override", where="trainer.checkpoint_glue",
                  called_by="_run_epoch", why="per-rank RNG lives in the hf_dist checkpoint's rng/ folder"),
    PrivateMember(owner=_T, name="_load_best_model", kind="override", where="trainer.checkpoint_glue",
                  called_by="_finalize_training", why="the best checkpoint is an hf_dist one (DCP shards)"),
    PrivateMember(owner=_T, name="_save", kind="override", where="trainer.trainer", called_by="save_model",
                  why="gather DTensor shards (hf_dist.state_dict) into a normal HF directory; PP: from every stage"),
    PrivateMember(owner=_T, name="_get_output_dir", kind="call", where="trainer.checkpoint_glue",
                  why="the run folder checkpoints go to (hyperparameter search trials included), as the Trainer's"),
    PrivateMember(owner=_T, name="_remove_unused_columns", kind="call", where="trainer.data",
                  why="the train loader hf_dist builds drops the columns the model does not take, as the Trainer's"),
    PrivateMember(owner=_T, name="_get_collator_with_removed_columns", kind="call", where="trainer.data",
                  why="the same for datasets that are not a datasets.Dataset"),
    PrivateMember(owner=_T, name="_prepare_inputs", kind="call", where="trainer.step",
                  why="a pipeline step moves its batch to the device as training_step would"),
    PrivateMember(owner=_T, name="_train_batch_size", kind="set", where="trainer.data",
                  why="under PP the data loader's batch is micro batch x micro-batches (accumulation runs inside the "
                      "pipeline)"),
    PrivateMember(owner=_T, name="_mixed_mesh_grad_norm", kind="call", where="tests (reference for TP norms)",
                  why="the Trainer's own norm over DTensor and plain gradients; tests compare against it"),
    PrivateMember(owner="transformers.PreTrainedModel", name="_is_distributed_loading_by_transformers", kind="set",
                  where="trainer.layout, pipeline_parallel.apply",
                  why="tells the Trainer the model owns placement and gradient reduction: no DDP wrap, no re-shard"),
    PrivateMember(owner=_A, name="prepare_data_loader", kind="patch", where="trainer.data",
                  why="under TP/PP the ranks of one model replica must read the same batch: shard by dp rank"),
    PrivateMember(owner=_A, name="gather_for_metrics", kind="patch", where="trainer.data",
                  why="gather eval results over dp only (TP/PP ranks hold copies); trimmed as accelerate trims"),
    PrivateMember(owner=_T, name="_loss_shifts_labels", kind="set", where="trainer.loss",
                  why="a causal LM with loss_type=None still shifts its labels (ForCausalLMLoss): num_items_in_batch "
                      "must count labels[..., 1:] as under PP, or the loss differs by layout"),
    PrivateMember(owner=_T, name="gather_function", kind="set", where="trainer.data",
                  why="the Trainer gathers eval results through it: over dp only under TP/PP, as gather_for_metrics"),
    PrivateMember(owner=_A, name="_dataloaders", kind="set", where="trainer.data",
                  why="accelerate tracks prepared loaders there (end-of-dataloader state for gather trimming)"),
    PrivateMember(owner="accelerate model", name="_is_accelerate_prepared", kind="set", where="trainer.trainer",
                  why="evaluate() before train() marks a bare model prepared; train() would then skip the DDP wrap"),
    PrivateMember(owner="transformers.TrainingArguments", name="save_only_model", kind="set",
                  where="trainer.checkpoint_glue",
                  why="flipped only while Trainer.__init__ runs: it refuses save_strategy for a model it did not "
                      "shard; hf_dist checkpoints it"),
    PrivateMember(owner="torch DistributedDataParallel", name="_sync_buffers", kind="patch", where="trainer.throughput",
                  why="times the buffer broadcast so the DDP communication wait is reported"),
    PrivateMember(owner="torch.distributed._state_dict_utils", name="_copy_state_dict", kind="call",
                  where="checkpoint.async_save",
                  why="copies the state into the staging buffers cached across async saves (the helper behind "
                      "BlockingAsyncStager's cache, which always pins memory and so needs a GPU)"),
)


def overrides() -> tuple[PrivateMember, ...]:
    """The DistTrainer methods that replace private Trainer methods."""
    return tuple(m for m in PRIVATE_MEMBERS if m.kind == "override")


def _ranges() -> str:
    return ", ".join(f"{pkg}{lo},{hi}" for pkg, (lo, hi) in TESTED_VERSIONS.items())


def installed_versions() -> dict[str, str]:
    """``{package: installed version}`` for the packages of ``TESTED_VERSIONS`` that are installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in TESTED_VERSIONS:
        try:
            out[package] = version(package)
        except PackageNotFoundError:  # peft and trl are optional
            continue
    return out


def untested_versions(installed: dict[str, str] | None = None) -> dict[str, str]:
    """``{package: installed version}`` for each installed package outside its ``TESTED_VERSIONS`` range (pure
    given ``installed``; a local build tag such as ``+cpu`` does not count)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = installed_versions() if installed is None else installed
    out = {}
    for package, found in installed.items():
        if package in TESTED_VERSIONS and Version(found).public not in SpecifierSet(",".join(TESTED_VERSIONS[package]),
                                                                                     prereleases=True):
            out[package] = found
    return out


_warned = False


def warn_untested_versions(installed: dict[str, str] | None = None) -> str | None:
    """Warn once per process, on the main process only, naming each installed version outside the tested range
    and the range; returns the message (``None`` when all are tested, already warned, or not the main process)."""
    global _warned
    outside = untested_versions(installed)
    if not outside or _warned or int(os.environ.get("RANK", "0")) != 0:
        return None
    _warned = True
    found = ", ".join(f"{pkg} {ver} (tested {','.join(TESTED_VERSIONS[pkg])})" for pkg, ver in outside.items())
    message = (f"hf_dist was tested with {_ranges()}; installed here: {found}. It may work, but nothing was run "
               f"on these versions; install the tested ones to be sure")
    logger.warning(message)
    return message


def check_internals() -> None:
    """Stop with the versions if a private Trainer/accelerate method hf_dist overrides or patches is gone; warn once
    (main process) when a package is outside its tested range."""
    from accelerate import Accelerator
    from transformers import Trainer

    owners = {_T: Trainer, _A: Accelerator}
    missing = [
        f"{m.owner}.{m.name}" for m in PRIVATE_MEMBERS
        if m.owner in owners and m.kind in ("override", "patch", "call") and not hasattr(owners[m.owner], m.name)
    ]
    if missing:
        import accelerate
        import transformers

        raise RuntimeError(
            f"hf_dist relies on {', '.join(missing)}, which transformers {transformers.__version__} / accelerate "
            f"{accelerate.__version__} no longer have; install the tested versions ({_ranges()})"
        )
    warn_untested_versions()

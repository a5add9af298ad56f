"""DistTrainer's ``save_steps`` / ``resume_from_checkpoint`` through hf_dist checkpoints, for the layouts it owns.

For FSDP2, TP and PP (applied by hf_dist, so the plain Trainer cannot checkpoint them), ``checkpoint-N`` is an
hf_dist checkpoint: sharded model + optimizer (DCP), scheduler, per-rank RNG, the data position, the layout and
batch contract, and the Trainer's ``trainer_state.json`` — committed atomically, with ``latest`` beside it.
Resuming loads model and optimizer after the optimizer exists and restores RNG where the Trainer restores it
(after skipping the batches already trained), so a resumed run continues the uninterrupted one. With
``--async_save`` the trainer's ``AsyncCheckpointer`` writes and commits in the background (retention after the
commit); ``wait_for_saves`` is called before anything reads a checkpoint back and when ``train()`` ends, so
``on_save`` callbacks may see the checkpoint before it is committed, and nothing else does.

DDP and DeepSpeed keep the Trainer's own checkpoints (accelerate / the DeepSpeed engine write them), but an
hf_dist checkpoint loads into any layout except DeepSpeed (``loads_with_hf_dist``): a run saved under FSDP2
resumes under DDP or in one process, resharded by DCP, with the same global batch.
Not here: the checkpoint format (``api``), retention policy (``retention``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch.distributed as dist

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.api import RNG_DIR, AsyncCheckpointer, save_checkpoint
from hf_dist.checkpoint.kind import checkpoint_kind
from hf_dist.checkpoint.load import load_checkpoint
from hf_dist.checkpoint.retention import RetentionPolicy
from hf_dist.checkpoint.safe_io import restore_rng

TRAINER_STATE_NAME = "trainer_state.json"


def _torch_optimizer(trainer):
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` wrapper."""
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def _trainer_state_json(trainer) -> str:
    from transformers.trainer_callback import ExportableState

    for callback in trainer.callback_handler.callbacks + [trainer.control]:
        if isinstance(callback, ExportableState):
            name, value = callback.__class__.__name__, callback.state()
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(value)
            else:
                trainer.state.stateful_callbacks[name] = value
    return json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n"


def save_trainer_checkpoint(trainer, trial) -> Path:
    """``Trainer._save_checkpoint`` for an hf_dist-owned layout (collective)."""
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()  # as the Trainer does: total_flos in trainer_state.json stays right
    run_dir = Path(trainer._get_output_dir(trial=trial))
    step = trainer.state.global_step
    output_dir = run_dir / f"checkpoint-{step}"
    if trainer.state.best_global_step:
        best = run_dir / f"checkpoint-{trainer.state.best_global_step}"
        if best.exists() or trainer.state.best_global_step == step:
            trainer.state.best_model_checkpoint = str(best)
    contract = trainer.args.batch_contract
    retention = None
    if trainer.args.save_total_limit:
        best = trainer.state.best_model_checkpoint
        retention = RetentionPolicy(keep_last=trainer.args.save_total_limit, protect=(Path(best).name,) if best else ())
    wait_for_saves(trainer)
    handle = save_checkpoint(
        output_dir,
        model=trainer.model,
        optimizer=_torch_optimizer(trainer),
        lr_scheduler=trainer.lr_scheduler,
        step=step,
        samples_consumed=step * contract.global_batch_size,
        layout=trainer.args.layout,  # the run's one Layout: mesh factors, name and description in the manifest
        batch_contract=contract,
        tokenizer=trainer.processing_class if trainer.args.should_save else None,
        extra_files={TRAINER_STATE_NAME: _trainer_state_json(trainer)},
        retention=retention,  # applied by rank 0 after the commit
        async_save=async_checkpointer(trainer) or False,
    )
    if not handle.done():
        trainer.pending_save = handle
    return output_dir


def async_checkpointer(trainer) -> AsyncCheckpointer | None:
    """The trainer's one ``AsyncCheckpointer`` with ``--async_save`` (copies in the background: the Trainer only
    changes parameters in ``optimizer.step``, which waits for the copy)."""
    if not trainer.args.async_save:
        return None
    if trainer.async_checkpointer is None:
        trainer.async_checkpointer = AsyncCheckpointer(stage_in_background=True)
    return trainer.async_checkpointer


def wait_for_saves(trainer) -> None:
    """Block until the last asynchronous save is committed (raises if its write failed)."""
    handle, trainer.pending_save = trainer.pending_save, None
    if handle is not None:
        handle.result()


def load_trainer_checkpoint(trainer, checkpoint) -> None:
    """Model, optimizer and scheduler from an hf_dist ``checkpoint-N`` (collective; RNG comes later)."""
    info = load_checkpoint(
        checkpoint,
        model=trainer.model,
        optimizer=_torch_optimizer(trainer),
        lr_scheduler=trainer.lr_scheduler,
        restore_rng=False,
    )
    saved = info.saved_batch_contract
    if saved is not None and saved.global_batch_size != trainer.args.batch_contract.global_batch_size:
        raise ValueError(
            f"{checkpoint} was trained with global_batch_size={saved.global_batch_size} but this run has "
            f"{trainer.args.batch_contract.global_batch_size}; resume with the same global batch (accumulation is "
            f"re-derived for the new world size)"
        )


def restore_trainer_rng(trainer, checkpoint) -> bool:
    """This rank's RNG from an hf_dist checkpoint, when saved by the same number of ranks."""
    manifest = mf.read_manifest(Path(checkpoint))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if manifest.world_size != world:
        return False
    restore_rng(Path(checkpoint) / RNG_DIR / f"rank_{rank:05d}.safetensors")
    return True


@contextlib.contextmanager
def sharded_checkpoints_accepted(args, owns_layout: bool):
    """Let ``Trainer.__init__`` accept ``save_strategy`` for a model whose layout hf_dist owns.

    The Trainer refuses it (it cannot checkpoint the optimizer of a model it did not shard); hf_dist does, through
    the overrides that call this module, so the refusal does not apply. ``save_only_model`` reads ``True`` only
    while the Trainer's constructor runs.
    """
    lift = owns_layout and str(args.save_strategy) not in ("no", "SaveStrategy.NO") and not args.save_only_model
    if lift:
        args.save_only_model = True
    try:
        yield
    finally:
        if lift:
            args.save_only_model = False


def load_best_model(trainer) -> None:
    """``load_best_model_at_end``: the model weights of the best hf_dist checkpoint, in place (collective)."""
    wait_for_saves(trainer)
    load_checkpoint(trainer.state.best_model_checkpoint, model=trainer.model, optimizer=None, restore_rng=False)


def loads_with_hf_dist(trainer, checkpoint) -> bool:
    """Whether ``checkpoint`` is loaded by hf_dist: any hf_dist checkpoint, into any layout but DeepSpeed's.

    A checkpoint written under FSDP2/TP/PP thus resumes under DDP or in one process too (resharded by DCP).
    """
    return checkpoint_kind(checkpoint) == "hf_dist" and not trainer.is_deepspeed_enabled

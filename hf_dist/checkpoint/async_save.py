"""Asynchronous saves that block training only for a memory copy: ``AsyncCheckpointer``.

An ``AsyncCheckpointer`` lives as long as the run and is passed to every ``save_checkpoint(...,
async_save=checkpointer)``. It owns what a save would otherwise rebuild each time:

- one gloo process group for the background write and commit (created at the first save; training
  collectives never share it);
- one staging cache: a CPU state dict shaped like the state (empty tensors, DTensors with the same mesh and
  placements), allocated at the first save; later saves only copy into it (torch's ``_copy_state_dict``, the
  helper behind ``BlockingAsyncStager(cache_staged_state_dict=True)``, which cannot be used itself without a
  GPU: it always pins), and a state of another shape (optimizer state that appeared, another model) gets new
  buffers. torch's ``DefaultStager`` caches too, but deep-copies every DTensor wrapper on each save (about 2x
  slower per save here), and ``_create_cpu_state_dict`` deep-copies each DTensor's data before replacing it;
- one writer thread, which writes the shards (DCP), the RNG and rank-0 files, fsyncs and hashes every file,
  writes the manifest and commits (rename, marker, then ``latest``): ``writer.write_and_commit``.

Staging (the copy) runs in the caller by default: when ``save_checkpoint`` returns, the parameters may change.
With ``stage_in_background=True`` the writer thread makes the copy too and the call returns after capturing the
small things (RNG, scheduler state, configs); the save then registers a one-shot ``optimizer.step`` pre-hook
that waits until the copy is done, so forward and backward overlap the copy and the next step cannot change a
value being copied. Anything else that changes parameters or optimizer state before that step (a manual update,
a load) must call ``SaveHandle.wait_staged()`` first.

A save waits for the previous save of the same checkpointer to finish first (its buffers are about to be
overwritten). A thread rather than DCP's process executor: the write is file I/O, fsync, hashing and copies,
which release the GIL, and a second process would need its own process group and shared-memory staging.
Interpreter exit joins the writer thread before ``atexit`` handlers run, so a pending commit finishes before
``hf_dist.trainer.teardown`` destroys the process groups.

Not here: what a checkpoint holds and the synchronous path (``api``), how it is written (``writer``).
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict
from torch.distributed.tensor import DTensor

from hf_dist.checkpoint import manifest as mf
from hf_dist.checkpoint.writer import SaveJob, rank_world, write_and_commit


class AsyncCheckpointer:
    """One gloo group, one staging cache and one writer thread, reused by every asynchronous save of a run.

    Call ``close()`` (or use it as a context manager) when the run ends: it waits for the last commit.

    Args:
        process_group: a gloo (CPU-capable) group for the background collectives; None creates one at the first
            save (collective: every rank saves).
        stage_in_background: copy the state in the writer thread too (see the module docstring for the rule
            this puts on the caller).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, stage_in_background: bool = False):
        self._group = process_group
        self.stage_in_background = stage_in_background
        self._stager = _CachedStager(pin_memory=torch.cuda.is_available())  # pinning pays off for GPU copies only
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_dist_checkpoint")
        self._pending: Future | None = None
        self._closed = False

    def submit(self, job: SaveJob) -> tuple[Future, Future]:
        """Stage ``job.state`` and write and commit ``job`` in the writer thread.

        Returns ``(committed, staged)``: the first resolves to the committed manifest, the second once the copy
        is made (already resolved unless ``stage_in_background``).
        """
        self._check_open()
        self.wait_idle()  # the previous save may still read the cached buffers
        group = self._background_group()
        staged: Future = Future()
        if self.stage_in_background:
            self._pending = self._executor.submit(self._stage_then_write, job, group, staged)
        else:
            job.state = self._stager.stage(job.state)
            staged.set_result(None)
            self._pending = self._executor.submit(write_and_commit, job, group)
        return self._pending, staged

    def _stage_then_write(self, job: SaveJob, group, staged: Future) -> mf.Manifest:
        error = None
        try:
            job.state = self._stager.stage(job.state)
            staged.set_result(None)
        except Exception as err:  # the other ranks learn it in the first collective of the write
            staged.set_exception(err)
            error = f"staging {job.target} failed on rank {rank_world()[0]}: {err!r}"
        return write_and_commit(job, group, prior_error=error)

    def wait_idle(self) -> None:
        """Block until the previous save finished (its failure is reported by its own ``SaveHandle``)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self._pending = None

    def close(self, wait: bool = True) -> None:
        """Release the writer thread and the staging cache (``wait=False``: once the pending save finished)."""
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        if wait or pending is None:
            self._release(wait=True)
        else:  # the callback runs in the writer thread, which cannot join itself
            pending.add_done_callback(lambda _: self._release(wait=False))

    def _release(self, wait: bool) -> None:
        self._executor.shutdown(wait=wait)
        self._stager.close()

    def _background_group(self):
        if self._group is None and rank_world()[1] > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _check_open(self) -> None:
        if self._closed:
            raise mf.CheckpointError("this AsyncCheckpointer was closed; create a new one to save again")

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _CachedStager:
    """Copies a state dict into CPU buffers allocated once per state-dict shape."""

    def __init__(self, pin_memory: bool):
        self._pin_memory = pin_memory
        self._cache: dict | None = None
        self._signature = None

    def stage(self, state: dict) -> dict:
        signature = _signature(state)
        if self._cache is None or signature != self._signature:
            self._cache, self._signature = _empty_like(state, self._pin_memory), signature
        return _copy_state_dict(state, self._cache)

    def close(self) -> None:
        self._cache, self._signature = None, None


def _signature(value):
    """Keys, tensor shapes, dtypes and DTensor layouts: what the cached buffers must match."""
    if isinstance(value, dict):
        return tuple((key, _signature(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_signature(item) for item in value)
    if isinstance(value, DTensor):
        local = value._local_tensor
        return ("dtensor", tuple(value.shape), tuple(local.shape), local.dtype, tuple(value.placements))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return type(value).__name__


def _empty_like(value, pin_memory: bool):
    """CPU buffers shaped like ``value``'s tensors (other values kept: the copy takes them from the source)."""
    if isinstance(value, dict):
        return {key: _empty_like(item, pin_memory) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_empty_like(item, pin_memory) for item in value)
    if isinstance(value, DTensor):
        local = _empty_like(value._local_tensor, pin_memory)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    if isinstance(value, torch.Tensor):
        buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return buffer.pin_memory() if pin_memory and buffer.numel() else buffer
    return value

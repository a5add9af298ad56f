"""Destroy the process groups at exit, while the interpreter is still whole.

Why: a script that ends without ``destroy_process_group()`` leaves gloo's C++ worker threads holding finished
work objects that reference tensors (Python objects). They are then freed during interpreter finalisation,
after the GIL machinery is torn down, and the process aborts with "terminate called without an active
exception" (exit -6), although training and saving finished. It is a race with finalisation, so it shows under
load (seen on the DDP recipe at load average ~7 on 2 cores). The upstream analysis: pytorch/pytorch PR 179291
and issue 190489. The HF Trainer and accelerate never destroy the group themselves (only
``Accelerator.end_training()`` does, which the Trainer does not call).

``register()`` (called by ``DistTrainer`` once the group exists) adds an ``atexit`` handler that waits for every
rank (gloo: a monitored barrier with a timeout, so a rank that already died cannot hang the others) and then
destroys all process groups. It runs on normal exit, on ``sys.exit`` (the preemption exit 75) and after an
uncaught exception; not after SIGKILL or ``os._exit``.

Not for: process groups a user script destroys itself (then the handler does nothing).
"""

from __future__ import annotations

import atexit
import datetime
import logging

import torch.distributed as dist

logger = logging.getLogger(__name__)

BARRIER_TIMEOUT = datetime.timedelta(seconds=60)
_registered = False


def register() -> None:
    """Destroy the process groups at interpreter exit (idempotent; a no-op without a process group)."""
    global _registered
    if not _registered:
        atexit.register(destroy_process_groups)
        _registered = True


def destroy_process_groups() -> None:
    """Barrier (gloo, bounded) then ``destroy_process_group()``; never raises (it runs at exit)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=BARRIER_TIMEOUT)  # rank 0 hosts the store: others leave first
    except Exception as err:  # a rank that died first: still free this one's threads
        logger.warning("exit barrier failed (%s); destroying the process group anyway", err)
    try:
        dist.destroy_process_group()
    except Exception as err:
        logger.warning("destroy_process_group at exit failed: %s", err)

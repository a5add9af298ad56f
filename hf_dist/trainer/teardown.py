"""Drain and destroy the process groups at exit, while the interpreter is still whole.

Why: a gloo collective still running when the script ends (an ``async_op=True`` work nobody waited for: a
prefetch, a functional collective, a background save's) is finished by one of gloo's C++ worker threads, which
then drops the work and its tensors. A tensor whose Python object was already released is owned by C++, so the
drop takes the GIL; once interpreter finalisation has begun, a thread taking the GIL is ended with
``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls ``std::terminate``: "terminate called
without an active exception", exit -6, although training and saving finished. A race with finalisation, so it
shows under load and rarely (3 of ~110 two-rank TP / EP / PP runs; on purpose in tests/test_teardown.py).

``destroy_process_group()`` alone does not prevent it: in torch 2.13 it unregisters the groups, but a gloo group
the model, FSDP2, a pipeline stage or a DeviceMesh still references keeps its worker threads (and their queue)
until that reference goes, during finalisation. Nor does one barrier: a gloo barrier holds weak references to the
work in flight when it was queued, and a work's tensors are freed only when its last weak reference goes, so a
barrier that a worker thread drops late frees, in that thread, the tensors of an all-gather the Trainer ran before
it (seen in a core dump: ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil``
-> ``pthread_exit``). So the handler, on every gloo group this rank belongs to, in the order the groups were
created (the same on every rank): (1) a barrier, which completes only after all work queued on its group before
it; (2) a pause without the GIL (``SETTLE_SECONDS``), in which the worker threads drop the finished work and the
barrier, whose weak references free the older work's tensors while the interpreter is whole; (3) a second barrier
and pause, so what the first barrier queued is dropped too. Each wait is bounded (``BARRIER_TIMEOUT``), so a rank
that already died cannot hang the others. The world group's barrier also keeps the rank that hosts the store until
every rank has left it. Then all groups are destroyed and ``gc.collect()`` frees the objects that only reference
cycles still kept (a Trainer made inside a function that has returned): a gloo group freed there joins its worker
threads now (torch releases the GIL in that destructor) rather than during finalisation.

``register()`` (called by ``DistTrainer`` once the group exists) adds that ``atexit`` handler. It runs on normal
exit, on ``sys.exit`` (the preemption exit 75) and after an uncaught exception; not after SIGKILL or
``os._exit``. The HF Trainer and accelerate never destroy the groups themselves (only
``Accelerator.end_training()`` does, which the Trainer does not call).

Not for: process groups a user script destroys itself (then the handler does nothing).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)

BARRIER_TIMEOUT = datetime.timedelta(seconds=60)
SETTLE_SECONDS = 0.2
"""How long this thread sleeps (GIL released) after each barrier round, for the gloo worker threads to drop what
they finished: 1 in ~25 two-rank DDP launches aborted at exit on a loaded 2-core machine without it."""
_registered = False


def register() -> None:
    """Destroy the process groups at interpreter exit (idempotent; a no-op without a process group)."""
    global _registered
    if not _registered:
        atexit.register(destroy_process_groups)
        _registered = True


def destroy_process_groups() -> None:
    """Drain every gloo group (bounded barriers), then ``destroy_process_group()``; never raises (it runs at exit)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    groups = gloo_groups_in_creation_order()
    try:
        for _ in range(2):  # 1: queued work completes and is dropped; 2: so is what the first barrier held
            for group in groups:
                dist.barrier(group=group, async_op=True).wait(timeout=BARRIER_TIMEOUT)
            time.sleep(SETTLE_SECONDS)  # GIL released: the worker threads drop the finished work now
    except Exception as err:  # a rank that died first: still free this one's threads
        logger.warning("exit barrier failed (%s); destroying the process groups anyway", err)
    try:
        dist.destroy_process_group()
    except Exception as err:
        logger.warning("destroy_process_group at exit failed: %s", err)
    del groups
    gc.collect()  # groups only cycles kept: destroyed (their worker threads joined) before finalisation


def gloo_groups_in_creation_order() -> list[dist.ProcessGroup]:
    """This rank's gloo groups of more than one rank, the world first, then in creation order (the same on every
    rank, so the barriers cannot wait on each other in a cycle)."""
    from torch.distributed.distributed_c10d import _world

    order = {pg: i for i, pg in enumerate(_world.pg_names)}  # insertion order = creation order
    groups = sorted(_world.pg_map, key=lambda pg: (pg is not dist.group.WORLD, order.get(pg, len(order))))
    return [pg for pg in groups if dist.get_backend(pg) == "gloo" and pg.size() > 1]

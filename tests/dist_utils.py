"""Spawn real gloo process groups on CPU for multi-rank tests.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo process group
in each, calls ``fn(rank, world_size, *args)`` and returns the list of per-rank return values (picklable).
A failure on any rank raises in the test with that rank's traceback. ``fn`` must be importable at module
level (spawn pickles it by name).
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # plain pickle: tensors travel as bytes, not as shared-memory handles that die with the child
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report any failure to the parent, with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
        elif any(p.exitcode not in (None, 0) for p in procs):
            # a rank died without reporting (segfault, kill)
            if queue.empty():
                errors.append("a rank exited without a result: exit codes " + str([p.exitcode for p in procs]))
                break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if errors else 30)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(results) < world_size:
        raise TimeoutError(f"only ranks {sorted(results)} of {world_size} finished within {timeout_s}s")
    return [results[r] for r in range(world_size)]


def launcher_env(path: str | Path) -> tuple[object, dict]:
    """What ``accelerate launch --config_file path`` hands its processes (the launcher's own code, no process)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = ["--config_file", str(path), "--main_process_port", str(free_port()), "train.py"]
    args = launch_command_parser().parse_args(argv)
    with mock.patch("torch.cuda.is_available", return_value=False):
        args, defaults, mixed_precision_from_config = _validate_launch_command(args)
        if not args.use_deepspeed:
            return args, prepare_multi_gpu_env(args)
        # as accelerate's launch_command does before deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]


def load_recipe():
    """examples/harbor/train.py as a module (it is a script, not part of the package), loaded once per process."""
    import importlib.util
    import sys

    if "harbor_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "harbor_train", Path(__file__).resolve().parents[1] / "examples" / "harbor" / "train.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up in sys.modules
        spec.loader.exec_module(module)
    return sys.modules["harbor_train"]


_SPAWNED: dict[tuple, tuple[bool, object]] = {}


def spawn_once(key: str, fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """``run_distributed(fn, world_size, *args)`` once per ``key`` in this pytest process: later calls get its per-rank
    results, or its failure raised again (a crashed spawn is not rerun by every test that reads it)."""
    if key not in _SPAWNED:
        try:
            _SPAWNED[key] = (True, run_distributed(fn, world_size, *args, timeout_s=timeout_s))
        except RuntimeError as err:
            _SPAWNED[key] = (False, err)
    ok, value = _SPAWNED[key]
    if not ok:
        raise value
    return value

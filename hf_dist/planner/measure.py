"""Measure what the memory model predicts, from the tensors themselves: for the benchmark and the tests.

``SavedTensorBytes`` counts the bytes autograd saves for backward during a forward (``saved_tensors_hooks``),
each storage once, leaving out parameters and views of parameters (they are model states, not
activations); DTensors count their local shard. ``model_state_bytes`` sums the distinct storages of the
parameters, gradients and optimizer state tensors of a module and optimizer (local shards for DTensors).
``peak_rss_bytes`` is the process's peak resident set size. ``allocated_peak(fn)`` is the allocator's own count: the
most bytes ``fn`` held allocated at once above what was allocated when it started (CUDA: the caching allocator's
statistics; CPU: the profiler's record of each allocation).

Not here: predictions (``memory.py``) or any DeepSpeed internals (``bench/memory.py`` reads those itself).
"""

from __future__ import annotations

import resource

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)


class StorageSet:
    """Distinct storages, counted once by address."""

    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}

    def add(self, t: torch.Tensor | None) -> None:
        if t is None:
            return
        storage = _local(t).untyped_storage()
        if storage.nbytes():
            self._sizes.setdefault(storage.data_ptr(), storage.nbytes())

    def __contains__(self, t: torch.Tensor) -> bool:
        return _local(t).untyped_storage().data_ptr() in self._sizes

    @property
    def nbytes(self) -> int:
        return sum(self._sizes.values())


class SavedTensorBytes:
    """Context manager: bytes saved for backward inside it, each storage once, parameters excluded."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self.params = StorageSet()
        for p in module.parameters() if module is not None else ():
            self.params.add(p)
        self.saved = StorageSet()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t) and t not in self.params:
            self.saved.add(t)
        return t

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return self.saved.nbytes


def model_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer_states"}``: distinct storage bytes of each."""
    params, grads, states = StorageSet(), StorageSet(), StorageSet()
    for p in module.parameters():
        params.add(p)
        grads.add(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    states.add(value)
    return {"parameters": params.nbytes, "gradients": grads.nbytes, "optimizer_states": states.nbytes}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: ``VmHWM`` where ``/proc`` has it, else ``ru_maxrss``.

    ``ru_maxrss`` is kept over ``execve`` (Linux saves the old address space's peak into it), so a process started by
    spawn or ``subprocess`` reports at least the RSS its parent had when it forked; ``VmHWM`` belongs to the new
    address space alone.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def allocated_peak(fn, device: str | torch.device = "cpu") -> int:
    """Run ``fn()``; the most bytes it held allocated at once on ``device``, above what was allocated before.

    On CUDA ``torch.cuda.max_memory_allocated``; on CPU the allocations and frees the CPU allocator reports to the
    profiler (``profile_memory=True``) while ``fn`` runs, added up in order: only allocations made inside ``fn`` count
    (a tensor allocated before and freed inside is not subtracted)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The allocator's running total (``total_allocated``) is not reset between profiles: a tensor allocated while
    # an earlier profile ran and freed after it stays in the total for good. So the total is rebuilt from this
    # profile's own records: each allocation made inside ``fn`` added, and subtracted again when it is freed.
    records, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # in tree order (an op's records inside it), which the stable sort keeps for equal times
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            records.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
        stack.extend(reversed(event.children))
    held: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(records, key=lambda r: r[0]):
        if size > 0:
            held[ptr] = size
            total += size
            peak = max(peak, total)
        else:
            total -= held.pop(ptr, 0)
    return peak

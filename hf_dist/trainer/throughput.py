"""Tokens/s, MFU, per-rank peak memory, per-rank busy time, stragglers and DDP communication wait.

``ThroughputMeter.step(model, inputs)`` wraps each micro step's ``training_step`` on every rank; ``report()`` is
called on every rank when the Trainer logs (the Trainer's own loss gathering makes that a collective point
already) and returns the figures to add to the log. ``tokens_per_second`` counts every token the model processed
(padding included); ``useful_tokens_per_second`` only the non-padding ones (``attention_mask`` ones, else labels
that are not -100, else all). Ranks of one tensor/pipeline group process the same tokens, so the cluster figures
divide by ``tp x pp``.

MFU = model FLOPs of the useful tokens / (seconds x devices x peak FLOP/s), with the planner's formula
(``hf_dist.planner.flops``: 6 x trainable and 4 x frozen matmul weights per token, plus the attention term at the
batch's sequence length); ``hfu`` adds the recomputed forward when activation checkpointing is on, over every
processed token. The device peak comes from the one GPU catalogue (``hf_dist.planner.catalogue``).

What the step-time figures measure (per rank, mean per micro step over the log interval):

- ``busy_seconds/rank{r}``: time inside ``training_step`` (forward, loss, backward; on CUDA between two events on
  the current stream, read at the next log so no micro step waits for the device) minus the *exposed* DDP
  gradient all-reduce wait measured below (CPU/gloo only). Under DDP on gloo that is the
  rank's own work, so a slow rank stands out. Under FSDP2, DeepSpeed, TP and PP the collectives inside
  forward/backward cannot be separated without a profiler, so busy time includes them: a fast rank waiting
  for a slow one reads busy too, and stragglers look milder than they are.
- ``comm_wait_seconds``: mean over ranks of the exposed DDP communication wait: the gradient all-reduce, timed
  by a DDP comm hook that wraps the default all-reduce, from the moment the last gradient bucket is ready
  (backward compute is done) to the completion of the last all-reduce; plus the blocking buffer broadcast
  DDP runs before each forward (``forward_sync_buffers``; Llama's rotary ``inv_freq`` is a buffer), timed
  around DDP's ``_sync_buffers``. Measured on gloo only: with NCCL the completion callback runs on the host
  before the kernel finishes, so host timestamps would be fiction; the key is then absent.

A straggler is a rank whose busy time exceeds ``straggler_ratio`` (1.2) x the median over ranks. The main
process prints and logs one warning when a rank becomes a straggler, and again only after it has recovered
and slowed down anew; ``straggler_ratio`` (max / median busy time) is in every training log.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hf_dist.planner.flops import FlopCounts

logger = logging.getLogger(__name__)

STRAGGLER_RATIO = 1.2


def default_peak_flops() -> float | None:
    """The peak dense bf16 FLOP/s of this process's GPU if known; None on CPU or an unknown device."""
    if not torch.cuda.is_available():
        return None
    from hf_dist.planner.catalogue import gpu_from_device_name

    spec = gpu_from_device_name(torch.cuda.get_device_name())
    return spec.peak_bf16_flops if spec is not None else None


def useful_tokens(inputs) -> int:
    """Non-padding tokens of a batch: ``attention_mask`` ones, else labels other than -100, else every token."""
    if not isinstance(inputs, Mapping):
        return 0
    for key, count in (("attention_mask", lambda t: int(t.sum())), ("labels", lambda t: int((t != -100).sum())),
                       ("input_ids", lambda t: t.numel())):
        value = inputs.get(key)
        if isinstance(value, torch.Tensor):
            return count(value)
    return 0


def peak_memory_bytes() -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    from hf_dist.planner.measure import peak_rss_bytes

    return peak_rss_bytes()


def find_stragglers(busy: list[float], ratio: float = STRAGGLER_RATIO) -> list[int]:
    """Ranks whose busy time exceeds ``ratio`` x the median busy time."""
    if len(busy) < 2:
        return []
    median = statistics.median(busy)
    return [rank for rank, t in enumerate(busy) if t > ratio * median]


class DdpCommTimer:
    """A DDP comm hook (default all-reduce, timed) that measures how long backward waits for the last bucket."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ready = 0.0
        self._last_done = 0.0
        self._buffer_sync = 0.0

    def hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        with self._lock:
            self._last_ready = time.perf_counter()

        def done(fut):
            with self._lock:
                self._last_done = time.perf_counter()
            return fut.value()

        return allreduce_hook(process_group, bucket).then(done)

    def time_buffer_sync(self, sync_buffers):
        """Wrap DDP's blocking pre-forward buffer broadcast so its wall time counts as communication."""

        def timed():
            start = time.perf_counter()
            try:
                return sync_buffers()
            finally:
                self._buffer_sync += time.perf_counter() - start

        return timed

    def take_exposed_wait(self) -> float:
        """Buffer-broadcast time plus last-bucket-ready to last-all-reduce-done, since the previous call."""
        with self._lock:
            wait = max(0.0, self._last_done - self._last_ready) if self._last_ready else 0.0
            wait += self._buffer_sync
            self._last_ready = self._last_done = self._buffer_sync = 0.0
        return wait


def _attach_comm_timer(model) -> DdpCommTimer | None:
    """Register the timed all-reduce on a DDP model when its backend is gloo; None otherwise."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    if dist.get_backend(model.process_group) != "gloo":
        return None
    timer = DdpCommTimer()
    try:
        model.register_comm_hook(model.process_group, timer.hook)
    except RuntimeError:  # the user registered a hook (e.g. fp16 compression): theirs stays, the wait is untimed
        return None
    if callable(getattr(model, "_sync_buffers", None)):  # private DDP method; untimed if a torch renames it
        model._sync_buffers = timer.time_buffer_sync(model._sync_buffers)
    return timer


class ThroughputMeter:
    """Counts tokens and busy time per rank and turns them into cluster-wide figures at each log."""

    def __init__(
        self, *, flops: FlopCounts | None, model_parallel: int, peak_flops: float | None, recompute: bool = False,
        straggler_ratio: float = STRAGGLER_RATIO,
    ) -> None:
        self.flops = flops
        self.recompute = recompute
        self.model_parallel = model_parallel
        self.peak_flops = peak_flops
        self.straggler_ratio = straggler_ratio
        self._comm_timer: DdpCommTimer | None = None
        self._hooked_model_id: int | None = None
        self._flagged: set[int] = set()
        self.warnings: list[str] = []
        """Straggler warnings issued by this process (main process only), in order."""
        self.reset()

    def count(self, inputs: dict) -> None:
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if ids is None:
            return
        useful = useful_tokens(inputs)
        self._tokens += ids.numel()
        self._useful += useful
        if self.flops is not None:
            model, hardware = self.flops.per_token(ids.shape[-1], recompute=self.recompute)
            self._model_flops += model * useful
            self._hardware_flops += hardware * ids.numel()

    @contextlib.contextmanager
    def step(self, model, inputs: dict):
        """Wrap one micro step's ``training_step``: count its tokens and time its busy part."""
        if id(model) != self._hooked_model_id:
            self._hooked_model_id = id(model)
            self._comm_timer = _attach_comm_timer(model)
        self.count(inputs)
        self._micro_steps += 1
        if torch.cuda.is_available():  # events, read at the next log: no host sync per micro step
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            yield
            end_event.record()
            self._cuda_events.append((start_event, end_event))
            return
        start = time.perf_counter()
        yield
        wait = self._comm_timer.take_exposed_wait() if self._comm_timer is not None else 0.0
        self._busy += time.perf_counter() - start - wait
        self._comm_wait += wait

    def _collect_cuda_busy(self) -> None:
        if self._cuda_events:
            torch.cuda.synchronize()
            self._busy += sum(start.elapsed_time(end) for start, end in self._cuda_events) / 1e3
            self._cuda_events = []

    def reset(self) -> None:
        self._cuda_events: list = []
        self._tokens = 0
        self._useful = 0
        self._model_flops = 0.0
        self._hardware_flops = 0.0
        self._busy = 0.0
        self._comm_wait = 0.0
        self._micro_steps = 0
        self._since = time.perf_counter()

    def report(self) -> dict[str, float]:
        self._collect_cuda_busy()
        elapsed = time.perf_counter() - self._since
        steps = max(self._micro_steps, 1)
        local = torch.tensor(
            [float(self._tokens), elapsed, float(peak_memory_bytes()), self._busy / steps, self._comm_wait / steps,
             float(self._useful), self._model_flops, self._hardware_flops],
            dtype=torch.float64,
        )
        if dist.is_available() and dist.is_initialized():
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
        else:
            gathered = [local]
        self.reset()
        tokens = sum(t[0].item() for t in gathered) / self.model_parallel
        wall = max(t[1].item() for t in gathered)
        useful = sum(t[5].item() for t in gathered) / self.model_parallel
        logs = {"tokens_per_second": tokens / wall if wall > 0 else 0.0,
                "useful_tokens_per_second": useful / wall if wall > 0 else 0.0}
        if self.peak_flops and self.flops is not None and wall > 0:
            denominator = wall * len(gathered) * self.peak_flops * self.model_parallel
            logs["mfu"] = sum(t[6].item() for t in gathered) / denominator
            if self.recompute:
                logs["hfu"] = sum(t[7].item() for t in gathered) / denominator
        for rank, t in enumerate(gathered):
            logs[f"peak_memory_gb/rank{rank}"] = round(t[2].item() / 2**30, 4)
        busy = [t[3].item() for t in gathered]
        for rank, seconds in enumerate(busy):
            logs[f"busy_seconds/rank{rank}"] = round(seconds, 6)
        if self._comm_timer is not None:
            logs["comm_wait_seconds"] = round(sum(t[4].item() for t in gathered) / len(gathered), 6)
        median = statistics.median(busy)
        logs["straggler_ratio"] = round(max(busy) / median, 4) if median > 0 else 1.0
        self._warn_new_stragglers(busy, median)
        return logs

    def _warn_new_stragglers(self, busy: list[float], median: float) -> None:
        stragglers = set(find_stragglers(busy, self.straggler_ratio))
        new = sorted(stragglers - self._flagged)
        self._flagged = stragglers
        is_main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if not new or not is_main:
            return
        for rank in new:
            message = (
                f"straggler: rank {rank} is busy {busy[rank]:.3f} s per micro step, {busy[rank] / median:.2f} x "
                f"the median {median:.3f} s over {len(busy)} ranks (threshold {self.straggler_ratio} x); "
                "check that rank's host for contention, throttling or a slow data loader"
            )
            self.warnings.append(message)
            logger.warning(message)  # with no handler configured, Python's last-resort handler prints it

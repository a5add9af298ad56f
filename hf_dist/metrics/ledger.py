"""A step ledger: what one optimizer step communicates, computes and in which precision, counted by torch itself.

``measure(labels)`` is a context manager that counts, on this rank, every collective and point-to-point transfer
(kind, process group, dtype, count, bytes) and every executed FLOP inside it, through two dispatch modes:

- ``CommCounter`` sees the c10d ops (``torch.ops.c10d.*``: what ``dist.all_reduce``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_to_all_single``, ``send``/``recv``, DDP's reducer, FSDP2 and
  ``torch.distributed.pipelining`` issue) and the functional collectives (``torch.ops._c10d_functional.*``: DTensor
  redistributions, i.e. TP). A functional collective runs its c10d op inside the handler, where the mode is off,
  so nothing counts twice. DTensor arguments are handed back (``NotImplemented``) so the mode sees the local ops.
- ``LocalFlopCounter`` is torch's ``FlopCounterMode`` on local tensors: a DTensor matmul is counted as the shard
  each rank multiplies, not as the global one on every rank.

Bytes are the size of the collective's whole buffer on one rank: the gathered output of an all-gather, the input
of a reduce-scatter or all-to-all, the tensor of an all-reduce, send or recv (what a ring moves is ``(n-1)/n`` of
it). ``attach_ledger(trainer)`` records one optimizer step of a ``Trainer`` (from the end of the step before to the
end of that step, so the batch's token count is in it), with the dtypes of parameters, gradients, optimizer
states and the loss, and the operand dtype of every counted matmul in forward and backward.

Not here: the theoretical minimum of a layout (``hf_dist.metrics.ledger_minimum``), the table (``bench/ledger.py``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

_C10D: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0), "barrier": ("barrier", -1),
}
"""c10d op -> (kind, index of the argument whose tensors are the whole buffer; -1: no payload)"""
_FUNCTIONAL: dict[str, tuple[str, int, int]] = {
    "all_reduce": ("all_reduce", 2, 1), "all_reduce_": ("all_reduce", 2, 1),
    "all_reduce_coalesced": ("all_reduce", 2, 1), "all_reduce_coalesced_": ("all_reduce", 2, 1),
    "all_gather_into_tensor": ("all_gather", 2, 0), "all_gather_into_tensor_out": ("all_gather", 2, 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 2, 0),
    "reduce_scatter_tensor": ("reduce_scatter", 3, 1), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 3, 1),
    "all_to_all_single": ("all_to_all", 3, 1), "broadcast": ("broadcast", 2, 1), "broadcast_": ("broadcast", 2, 1),
}
"""functional collective -> (kind, index of ``group_name``, payload multiplier: 0 means x the group size)"""


@dataclass(frozen=True, order=True)
class CommKey:
    """One row of the communication ledger."""

    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send``, ``recv``, ``broadcast``, ..."""
    group: str
    """The mesh axis names of the process group (``"dp_shard/dp"``), ``"world"``, or its group name."""
    dtype: str
    """The payload's dtype (``float32``, ``bfloat16``, ``int64``); ``-`` for a barrier."""


@dataclass
class Tally:
    count: int = 0
    bytes: int = 0
    sizes: list[int] = field(default_factory=list)
    """Bytes of each call, in order (to tell one bucket from many, a scalar from a gradient)."""
    sites: dict[str, int] = field(default_factory=dict)
    """Caller outside torch -> calls (with ``measure(where=True)``): who issued each collective."""


@dataclass
class StepLedger:
    """What one rank did during the measured region."""

    comms: dict[CommKey, Tally] = field(default_factory=lambda: defaultdict(Tally))
    flops: int = 0
    """Executed FLOPs on this rank (matmuls, convolutions, attention: ``FlopCounterMode``'s registry)."""
    param_dtypes: dict[str, int] = field(default_factory=dict)
    """dtype -> elements of this rank's local parameters (shards)."""
    grad_dtypes: dict[str, int] = field(default_factory=dict)
    """dtype -> elements of the local gradients just before the optimizer step."""
    loss_dtype: str = "-"
    matmul_dtypes: dict[str, dict[str, int]] = field(default_factory=dict)
    """``forward``/``backward`` -> operand dtype -> FLOPs: the precision the matmuls and attention really ran in
    (under autocast the parameters stay fp32 and only this shows bf16)."""
    optimizer_dtypes: dict[str, int] = field(default_factory=dict)
    """dtype -> elements of this rank's optimizer state tensors (Adam moments, SGD momentum; not 0-d steps)."""

    def add(self, kind: str, group: str, tensors: list[torch.Tensor], multiplier: int = 1, site: str = "") -> None:
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
        nbytes = sum(t.numel() * t.element_size() for t in tensors) * multiplier
        tally = self.comms[CommKey(kind, group, dtype)]
        tally.count += 1
        tally.bytes += nbytes
        tally.sizes.append(nbytes)
        if site:
            tally.sites[site] = tally.sites.get(site, 0) + 1

    def plain(self) -> dict:
        """A picklable copy (no defaultdict, no tensors)."""
        return {"comms": {k: Tally(v.count, v.bytes, list(v.sizes), dict(v.sites)) for k, v in self.comms.items()},
                "flops": self.flops, "param_dtypes": dict(self.param_dtypes), "grad_dtypes": dict(self.grad_dtypes),
                "loss_dtype": self.loss_dtype, "optimizer_dtypes": dict(self.optimizer_dtypes),
                "matmul_dtypes": {phase: dict(d) for phase, d in self.matmul_dtypes.items()}}


def _is_dtensor_type(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, type) and issubclass(t, DTensor)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class CommCounter(TorchDispatchMode):
    """Counts c10d and functional collectives into a ``StepLedger``; ``labels`` maps group names to axis names."""

    def __init__(self, ledger: StepLedger, labels: dict[str, str], where: bool = False):
        super().__init__()
        self.ledger, self.labels, self.where = ledger, labels, where

    def _site(self) -> str:
        """The innermost caller outside torch (and this module), as ``package/file.py:line function``."""
        if not self.where:
            return ""
        import traceback

        for frame in reversed(traceback.extract_stack()[:-3]):
            path = frame.filename.replace("\\", "/")
            # deepspeed.comm, its profiling decorator and the deprecation wrapper only pass the call on
            if "/torch/" in path or "/deepspeed/comm/" in path or path.endswith(
                    ("/contextlib.py", "/ledger.py", "/typing_extensions.py", "/deepspeed/utils/nvtx.py")):
                continue
            return f"{'/'.join(path.split('/')[-2:])}:{frame.lineno} {frame.name}"
        return "torch"

    def _label(self, group) -> str:
        if isinstance(group, torch.ScriptObject):  # a c10d op's process group, boxed
            from torch.distributed import ProcessGroup

            group = ProcessGroup.unbox(group)
        name = group if isinstance(group, str) else getattr(group, "group_name", "?")
        return self.labels.get(name, name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented  # let DTensor redistribute and run local ops, which come back here
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "c10d" and name in _C10D:
            kind, payload = _C10D[name]
            group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)  # the first: the group
            self.ledger.add(kind, self._label(group), _tensors(args[payload]) if payload >= 0 else [],
                            site=self._site())
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind, group_at, multiplier = _FUNCTIONAL[name]
            group = args[group_at] if len(args) > group_at else kwargs.get("group_name")
            size = args[1] if multiplier == 0 else multiplier  # all-gathers: group_size is the second argument
            self.ledger.add(kind, self._label(group), _tensors(args[0]), size, site=self._site())
        return func(*args, **kwargs)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm`` (transformers' ``grouped_mm`` experts): every output element is one dot product over
    ``a``'s last dim, except 2-D x 2-D, where the groups split the contraction (the weight gradient)."""
    out = 1
    for n in out_shape:
        out *= n
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out // out_shape[0] * a_shape[1]
    return 2 * out * a_shape[-1]


def _cpu_sdpa_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, q, k, v)  # recomputes the scores: 5 matmuls


class LocalFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` counting the local shards a DTensor op multiplies (not the global op on every rank),
    plus the ops torch 2.13's registry lacks: the CPU flash attention (what SDPA runs here) and ``_grouped_mm``."""

    def __init__(self):
        aten = torch.ops.aten
        super().__init__(display=False, custom_mapping={
            aten._grouped_mm: _grouped_mm_flops,
            aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
        })
        self.by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        """``forward``/``backward`` -> the first operand's dtype -> FLOPs"""

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            operand = next((t for t in _tensors(args) if t.is_floating_point()), None)
            if operand is not None:  # the autograd engine runs backward: its graph task id is set
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
                self.by_dtype[phase][str(operand.dtype).removeprefix("torch.")] += flops
        return super()._count_flops(func_packet, out, args, kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


def group_labels(dims=None) -> dict[str, str]:
    """Group name -> the mesh axes over it (``"dp_shard/dp"``), and the default group -> ``"world"``."""
    import torch.distributed as dist

    labels: dict[str, list[str]] = defaultdict(list)
    if dist.is_initialized():
        labels[dist.group.WORLD.group_name].append("world")
    if dims is not None and getattr(dims, "_mesh", None) is not None:
        axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "ep", "efsdp")
        for axis in axes:
            try:
                mesh = dims.get_mesh(axis)
            except ValueError:
                continue
            if mesh.size() > 1:
                labels[mesh.get_group().group_name].append(axis)
    return {name: "/".join(axes) for name, axes in labels.items()}


@contextlib.contextmanager
def measure(labels: dict[str, str] | None = None, *, where: bool = False, flops: bool = True):
    """Count the collectives and FLOPs of the enclosed region on this rank; yields the ``StepLedger``.
    ``where=True`` also records which caller outside torch issued each collective (``Tally.sites``);
    ``flops=False`` counts communication only (cheaper, for timed loops)."""
    ledger = StepLedger()
    counter = LocalFlopCounter() if flops else contextlib.nullcontext()
    with counter, CommCounter(ledger, labels or {}, where):
        yield ledger
    if flops:
        ledger.flops = int(counter.get_total_flops())
        ledger.matmul_dtypes = {phase: dict(d) for phase, d in counter.by_dtype.items()}


def local_dtypes(tensors) -> dict[str, int]:
    """dtype -> elements of the local tensors (a DTensor's shard)."""
    out: dict[str, int] = defaultdict(int)
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)
        out[str(local.dtype).removeprefix("torch.")] += local.numel()
    return dict(out)


class _LedgerCallback:
    """Measures optimizer step ``step`` of a Trainer: from the end of step ``step - 1`` to the end of ``step``."""

    def __init__(self, trainer, step: int, where: bool):
        self.trainer, self.step, self.where = trainer, step, where
        self.ledger: StepLedger | None = None
        self._stack: contextlib.ExitStack | None = None

    def _model(self):
        return self.trainer.model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            self._stack = contextlib.ExitStack()
            self.ledger = self._stack.enter_context(measure(group_labels(getattr(self.trainer, "dims", None)),
                                                                   where=self.where))
        elif state.global_step == self.step and self._stack is not None:
            self._stack.close()
            self._stack = None
            self.ledger.param_dtypes = local_dtypes(self._model().parameters())
            optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # accelerate's wrapper
            self.ledger.optimizer_dtypes = local_dtypes(
                t for state in optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._stack is not None:
            self.ledger.grad_dtypes = local_dtypes(p.grad for p in self._model().parameters())

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def attach_ledger(trainer, step: int = 2, *, where: bool = False) -> _LedgerCallback:
    """Measure optimizer step ``step`` (>= 2: the first builds optimizer states) of ``trainer.train()``; read
    ``callback.ledger`` afterwards. Also records the dtype of the loss ``training_step`` returns."""
    if step < 2:
        raise ValueError(f"step={step}: the ledger measures from the end of step - 1; use step >= 2")
    callback = _LedgerCallback(trainer, step, where)
    trainer.add_callback(callback)
    training_step = trainer.training_step

    def recording(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        if callback._stack is not None:
            callback.ledger.loss_dtype = str(loss.dtype).removeprefix("torch.")
        return loss

    trainer.training_step = recording
    return callback

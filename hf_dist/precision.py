"""Which precision a layout runs, and the dtype of each class of tensor in it: one record the planner forecasts
memory with and the step ledger (``hf_dist.metrics.ledger``) is checked against.

``precision_that_runs(layout, asked)`` maps what the user asks for (``MIXED_PRECISIONS``: ``--bf16``, fp32, or a
model loaded in bf16) to the preset the layout runs (``PRECISIONS``); ``tensor_dtypes(layout, preset)`` says, for
that preset, the dtype of the parameters each rank stores, their gradients, the optimizer states, the matmul
operands, the residual stream between layers, the parameters FSDP2 gathers and the gradient reduction.

Measured on 2 gloo ranks per layout by ``tests/test_bf16_layouts.py`` (the ledger of a real step), which asserts
that each torch row below is what runs. Not here: byte arithmetic (``hf_dist.planner``), the layouts themselves
(``hf_dist.strategy``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from hf_dist.strategy import Layout

MixedPrecision = Literal["bf16", "fp32", "pure_bf16"]
MIXED_PRECISIONS: tuple[str, ...] = ("bf16", "fp32", "pure_bf16")
"""What the user asks for: ``bf16`` (``--bf16`` with fp32 master weights), ``fp32``, or ``pure_bf16`` (a model
loaded in bf16 and trained with no fp32 copy: bf16 parameters, gradients and Adam states, 8 bytes/parameter)."""
Precision = Literal["fp32", "bf16_autocast", "bf16_mixed", "pure_bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16_autocast", "bf16_mixed", "pure_bf16")


def precision_that_runs(layout: Layout, mixed_precision: str) -> Precision:
    """Which tensors are bf16 when ``layout`` trains with ``mixed_precision`` (``MIXED_PRECISIONS``).

    With ``bf16``: FSDP2 (hf_dist's ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``) and DeepSpeed keep an fp32 master and compute with bf16 parameters
    (``bf16_mixed``); DDP and DDP x TP/CP keep fp32 parameters and compute under ``torch.autocast``
    (``bf16_autocast``, the Trainer's ``--bf16``). Pipeline stages do not autocast: with ``pp > 1`` the model
    is loaded in bf16 and trains in bf16 throughout (``pure_bf16``).
    """
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"precision={mixed_precision!r} is not known; use one of {', '.join(MIXED_PRECISIONS)}")
    if layout.is_deepspeed and mixed_precision == "pure_bf16":
        return "bf16_mixed"  # DeepSpeed keeps an fp32 master partition whatever the module's dtype
    if mixed_precision != "bf16":
        return mixed_precision  # type: ignore[return-value]
    if layout.pp > 1:
        return "pure_bf16"
    return "bf16_mixed" if layout.is_fsdp or layout.is_deepspeed else "bf16_autocast"


@dataclass(frozen=True, kw_only=True)
class TensorDtypes:
    """The dtype (``float32`` / ``bfloat16``) of each class of tensor in one rank's training step."""

    parameters: str
    """What each rank stores (FSDP2: its shards, the master copy)."""
    gradients: str
    """What the optimizer steps on."""
    optimizer_states: str
    """Adam moments / SGD momentum (they follow the stored parameters)."""
    matmuls: str
    """The operands of the linear layers and attention, forward and backward."""
    residual: str
    """The hidden states between layers (what TP, SP, CP and PP exchange besides attention's q, k, v)."""
    gathered: str
    """The parameters FSDP2 all-gathers for a unit's forward and backward."""
    reduction: str
    """The gradient reduction across data-parallel ranks (DDP all-reduce, FSDP2 reduce-scatter)."""


_F32, _BF16 = "float32", "bfloat16"
PRECISION_DTYPES: dict[str, TensorDtypes] = {
    "fp32": TensorDtypes(parameters=_F32, gradients=_F32, optimizer_states=_F32, matmuls=_F32, residual=_F32,
                         gathered=_F32, reduction=_F32),
    # torch.autocast casts each matmul's operands; everything else (norms, residual adds, rotary) stays fp32
    "bf16_autocast": TensorDtypes(parameters=_F32, gradients=_F32, optimizer_states=_F32, matmuls=_BF16,
                                  residual=_F32, gathered=_F32, reduction=_F32),
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards, bf16 units, fp32 reduce-scatter
    "bf16_mixed": TensorDtypes(parameters=_F32, gradients=_F32, optimizer_states=_F32, matmuls=_BF16,
                               residual=_BF16, gathered=_BF16, reduction=_F32),
    "pure_bf16": TensorDtypes(parameters=_BF16, gradients=_BF16, optimizer_states=_BF16, matmuls=_BF16,
                              residual=_BF16, gathered=_BF16, reduction=_BF16),
}
"""preset -> dtypes, for the layouts torch runs (DDP, FSDP2, TP, SP, PP, CP, EP); DeepSpeed keeps its own."""
_DEEPSPEED_BF16 = TensorDtypes(parameters=_BF16, gradients=_BF16, optimizer_states=_F32, matmuls=_BF16,
                               residual=_BF16, gathered=_BF16, reduction=_BF16)
"""DeepSpeed ``bf16`` (forecast from its documented engine, not measured here): bf16 module parameters and
gradients, reduced in bf16, with the fp32 master partition and Adam states inside the optimizer."""


def tensor_dtypes(layout: Layout, precision: str) -> TensorDtypes:
    """The dtypes of ``layout`` training in ``precision`` (a ``PRECISIONS`` preset). FSDP2 reduce-scatters in fp32
    whenever it computes in bf16 (``reduce_dtype=float32``, also on a bf16-loaded model: a sum over many ranks
    in bf16 loses the small gradients), then stores the result in the parameters' dtype."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision={precision!r} is not a preset; use one of {', '.join(PRECISIONS)}")
    if layout.is_deepspeed and precision != "fp32":
        return _DEEPSPEED_BF16
    dtypes = PRECISION_DTYPES[precision]
    if layout.is_fsdp and precision != "fp32":
        dtypes = replace(dtypes, reduction=_F32)
    return dtypes


def itemsize(dtype: str) -> int:
    """Bytes per element of ``float32`` / ``bfloat16``."""
    return {_F32: 4, _BF16: 2}[dtype]

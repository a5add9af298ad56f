"""LoRA (PEFT) on a tensor-parallel model: adapters sharded the same way as the layer they adapt.

PEFT wraps a Linear as ``base_layer`` plus ``lora_A[adapter]`` / ``lora_B[adapter]`` and adds
``lora_B(lora_A(x)) * scale`` to the base output, so both paths must produce the same layout:

- column-parallel base (q/k/v, gate/up): ``lora_A`` whole on every rank (its input is replicated), ``lora_B``
  column-parallel like the base (fused parts included), so the adapter output is this rank's columns;
- row-parallel base (o/down): ``lora_A`` row-parallel like the base (its input is this rank's columns, its
  output is all-reduced), ``lora_B`` whole on every rank;
- a KV projection with fewer KV heads than TP ranks (``ReplicatedKVColwise``): the whole LoRA layer (base and
  both halves) whole on every rank, its summed output sliced to this rank's KV head, the gradients of the halves
  summed over the TP ranks as the base's would be.

The whole halves see identical inputs and identical output gradients on every TP rank, so their gradients
and updates are identical: all TP ranks keep the same adapter. Apply PEFT first, then TP.
Not for: LoRA on embeddings or lm_head, or LoRA with sequence parallelism (rejected with a ``ValueError``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from hf_dist.tensor_parallel.classic_styles import Conv1DColwise, Conv1DFusedSlice, Conv1DRowwise
from hf_dist.tensor_parallel.match import match_plan
from hf_dist.tensor_parallel.styles import ReplicatedKVColwise


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def has_lora_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds a PEFT LoRA layer."""
    return any(_is_lora_layer(module) for module in model.modules())


def _lora_entries(pattern: str, module: nn.Module, style: ParallelStyle) -> dict[str, ParallelStyle]:
    if isinstance(style, ReplicatedKVColwise):  # replicates every parameter under the layer and slices its output
        return {pattern: style}
    entries = {f"{pattern}.base_layer": style}
    if isinstance(style, (Conv1DColwise, Conv1DRowwise, Conv1DFusedSlice)):
        raise ValueError(
            f"LoRA on {pattern!r} (a GPT-2 Conv1D) with tensor parallelism is not supported: its adapters are Linears "
            f"laid out the other way round; use tp_size=1 with LoRA on this model (FSDP2 or DDP)"
        )
    if isinstance(style, ColwiseParallel):
        sharded_half = "lora_B"
    elif isinstance(style, RowwiseParallel):
        sharded_half = "lora_A"
    else:
        raise ValueError(f"LoRA on {pattern!r} with tensor-parallel style {style!r} is not supported")
    for adapter in getattr(module, sharded_half):
        entries[f"{pattern}.{sharded_half}.{adapter}"] = style
    return entries


def expand_plan_for_lora(
    model: nn.Module, plan: dict[str, ParallelStyle], *, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """Rewrite plan entries that name PEFT LoRA layers into entries for their base layer and adapters."""
    lora_names = {name for name, module in model.named_modules() if _is_lora_layer(module)}
    if not lora_names:
        return plan
    if sequence_parallel:
        raise ValueError("LoRA with sequence_parallel=True is not supported; use sequence_parallel=False with LoRA")
    expanded: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        hits = [name for name, _ in match_plan(model, {pattern: style}, optional=frozenset({pattern}))]
        lora_hits = [name for name in hits if name in lora_names]
        if not lora_hits:
            expanded[pattern] = style
            continue
        if len(lora_hits) != len(hits):
            raise ValueError(f"plan entry {pattern!r} names both LoRA-wrapped and plain modules; target all or none")
        for name in lora_hits:
            expanded.update(_lora_entries(name, model.get_submodule(name), style))
    return expanded

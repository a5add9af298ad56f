"""``torch.compile`` per transformer block: the compile step of ``hf_dist.parallelize`` (after TP and activation
checkpointing, before FSDP, as torchtitan orders it).

Each block is compiled in place (``nn.Module.compile``): its parameters, their FQNs and state-dict keys stay as
they were, so checkpoints, TP/FSDP wrapping and the model's own forward are untouched; only the block's call runs
through dynamo. The blocks are the same modules FSDP shards as units (``_no_split_modules``), so FSDP's hooks stay
outside the compiled regions -- compiling the whole model instead breaks its graph at every FSDP hook (accelerate's
whole-model wrapper, measured: 5 graphs under FSDP2 on 2 ranks); per block, the graph count is the block count.

``CompileStats`` reads dynamo's counters (graphs, graph breaks with their reasons); ``DistTrainer`` reports them once
after the first optimizer step, and the graphs compiled after it (recompiles: new shapes, changed guards) once at the
end of training.

Not for: choosing whether to compile (``DistTrainingArguments.torch_compile``, the Trainer's own flag) or stopping
accelerate from compiling the whole model a second time (``hf_dist.trainer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(kw_only=True, frozen=True)
class CompileRequest:
    """How ``parallelize`` compiles each block (``torch.compile`` arguments)."""

    backend: str = "inductor"
    """``torch.compile`` backend (``inductor`` needs a C++ compiler on CPU)."""
    mode: str | None = None
    """``torch.compile`` mode (``default``, ``reduce-overhead``, ``max-autotune``, ...); None: torch's default."""
    fullgraph: bool = False
    """Refuse graph breaks inside a block (an error) instead of splitting the block's graph."""

    @classmethod
    def from_args(cls, args) -> CompileRequest | None:
        """The request ``TrainingArguments`` carry (``torch_compile``, ``torch_compile_backend/_mode``); None: off."""
        if not getattr(args, "torch_compile", False):
            return None
        return cls(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)


def compile_blocks(blocks: Sequence[nn.Module], request: CompileRequest) -> int:
    """Compile each of ``blocks`` in place; the number compiled."""
    for block in blocks:
        block.compile(backend=request.backend, mode=request.mode, fullgraph=request.fullgraph)
        block.hf_dist_compile = request  # what is_block_compiled reads (torch keeps its compiled call private)
    return len(blocks)


def is_block_compiled(module: nn.Module) -> bool:
    """Whether ``compile_blocks`` compiled ``module``."""
    return isinstance(getattr(module, "hf_dist_compile", None), CompileRequest)


@dataclass(kw_only=True, frozen=True)
class CompileStats:
    """Dynamo's counters in this process (cumulative since start or ``torch._dynamo.reset``)."""

    graphs: int
    """Graphs compiled (each block once, plus one per graph break, plus recompiles)."""
    graph_breaks: int
    """Graph breaks."""
    break_reasons: tuple[str, ...]
    """Distinct graph-break reasons."""

    @classmethod
    def now(cls) -> CompileStats:
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        return cls(graphs=int(counters["stats"]["unique_graphs"]), graph_breaks=int(sum(breaks.values())),
                   break_reasons=tuple(sorted(breaks)))

    def describe(self, blocks: int) -> str:
        reasons = f" ({'; '.join(r.splitlines()[0] for r in self.break_reasons)})" if self.break_reasons else ""
        return (f"torch.compile per block: {blocks} blocks compiled, {self.graphs} graphs, "
                f"{self.graph_breaks} graph breaks{reasons}")

"""``--torch_compile`` under ``DistTrainer``: the blocks compiled by hf_dist (``hf_dist.compile``), not the whole
model by accelerate, and dynamo's graph / graph-break / recompile counts reported once.

The Trainer hands ``torch_compile`` to accelerate as a ``TorchDynamoPlugin``, which wraps the whole prepared model
in ``torch.compile`` (its graph breaks at every FSDP hook). With hf_dist compiling per block, that plugin is built
with no backend (``accelerate_compiles_nothing``) so the model is not compiled twice. Under DeepSpeed, whose ZeRO-3
hooks live inside the blocks, accelerate keeps compiling as it does (its ``compile_regions_deepspeed``).

Not for: the compile itself (``hf_dist.compile``) or where it sits in the layout (``hf_dist.parallelize``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from transformers import TrainerCallback

from hf_dist.compile import CompileRequest, CompileStats, is_block_compiled

logger = logging.getLogger(__name__)


def compile_request(args) -> CompileRequest | None:
    """What hf_dist compiles for this run: None without ``torch_compile`` or under DeepSpeed (accelerate's)."""
    if args.layout.is_deepspeed:
        return None
    return CompileRequest.from_args(args)


@contextlib.contextmanager
def accelerate_compiles_nothing(args) -> Iterator[None]:
    """While the Trainer builds its ``Accelerator``: no dynamo backend when hf_dist compiles the blocks itself."""
    if compile_request(args) is None:
        yield
        return
    backend = args.torch_compile_backend
    args.torch_compile_backend = None  # the Trainer's TorchDynamoPlugin(backend=None): accelerate compiles nothing
    try:
        yield
    finally:
        args.torch_compile_backend = backend


class CompileReport(TrainerCallback):
    """Logs the compiled blocks, graphs and graph breaks after the first step; recompiles at the end of training."""

    def __init__(self) -> None:
        self.first: CompileStats | None = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.first is None:
            self.first = CompileStats.now()
            if args.should_log:
                blocks = sum(is_block_compiled(m) for m in model.modules()) if model is not None else 0
                logger.warning(self.first.describe(blocks))

    def on_train_end(self, args, state, control, **kwargs):
        if self.first is None:
            return
        recompiles = CompileStats.now().graphs - self.first.graphs
        if recompiles and args.should_log:
            logger.warning("torch.compile: %d graphs compiled after the first step (recompiles: new shapes or "
                           "changed guards; pad batches to fixed lengths to avoid them)", recompiles)

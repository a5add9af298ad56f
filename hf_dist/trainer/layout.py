"""Apply a parallel layout to an HF causal LM, in one visible order: TP, then activation checkpointing, then FSDP.

``apply_layout`` is the only place that changes a model for a layout hf_dist owns (FSDP2, TP, PP). DDP and
DeepSpeed are left to accelerate, which does them correctly on CPU and GPU once ``use_cpu`` is right
(``hf_dist.trainer.launch_env``).

Not here: deciding the layout (``DistTrainer`` builds ``ParallelDims``) or checkpointing.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_dist.parallel_dims import ParallelDims
from hf_dist.trainer.launch_env import FsdpRequest


def layout_dims(*, world_size: int, tp: int, pp: int, fsdp: bool, dp_replicate: int = 1) -> ParallelDims:
    """The ``ParallelDims`` of a DistTrainer run: data-parallel ranks shard under FSDP (HSDP: inside each of
    ``dp_replicate`` groups), replicate otherwise (``hf_dist.strategy.strategy_dims``, the one mapping)."""
    from hf_dist.strategy import strategy_dims

    strategy = ("fsdp_hybrid_shard" if dp_replicate > 1 else "fsdp_full_shard") if fsdp else "ddp"
    return strategy_dims(strategy, world_size=world_size, tp=tp, pp=pp, dp_replicate=dp_replicate)


def find_blocks(model: nn.Module, class_names: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The transformer blocks to shard as units: ``class_names`` or the model's ``_no_split_modules``."""
    if class_names is None:
        names = getattr(model, "_no_split_modules", None) or getattr(
            getattr(model, "get_base_model", lambda: model)(), "_no_split_modules", None
        )
        class_names = tuple(names or ())
    blocks = [m for m in model.modules() if type(m).__name__ in class_names]
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"no module of class {list(class_names)} in {type(model).__name__}, so FSDP would shard the whole model "
            f"as one unit; set the wrap class (fsdp_transformer_layer_cls_to_wrap) to one of: {present}"
        )
    return blocks


def apply_fsdp(model: nn.Module, dp_mesh, request: FsdpRequest, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` every block, then the root; reduce in fp32 when computing in lower precision."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
    )
    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=mp_policy,
        offload_policy=CPUOffloadPolicy() if request.cpu_offload else OffloadPolicy(),
    )
    for block in find_blocks(model, request.wrap_classes):
        fully_shard(block, reshard_after_forward=request.reshard_after_forward, **kwargs)
    # The root's parameters (embeddings, final norm, lm_head) are used first in backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant, which composes with DTensor and FSDP2)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads") and not any(p.requires_grad for p in target.get_input_embeddings().parameters()):
        model.enable_input_require_grads()  # LoRA on a frozen base: checkpointed blocks need a grad-requiring input


def apply_layout(
    model: nn.Module,
    dims: ParallelDims,
    *,
    fsdp: FsdpRequest | None,
    activation_checkpointing: bool,
    param_dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
) -> nn.Module:
    """Apply TP, then activation checkpointing, then FSDP2 to ``model`` for ``dims`` (mesh already built)."""
    if dims.tp_enabled:
        from hf_dist.tensor_parallel import apply_tensor_parallel

        model = apply_tensor_parallel(
            model, dims.get_mesh("tp"), sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel
        )
    if activation_checkpointing or (fsdp is not None and fsdp.activation_checkpointing):
        apply_activation_checkpointing(model)
    if fsdp is not None:
        # HSDP: a 2-D (replicate, shard) mesh; FSDP2 all-reduces across the first axis and shards over the second
        mesh = dims.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else dims.get_mesh("dp")
        model = apply_fsdp(model, mesh, fsdp, param_dtype)
    elif dims.tp_enabled and dims.dp_enabled:  # DDP cannot wrap DTensor parameters: average over dp ourselves
        from hf_dist.tensor_parallel.compose import replicate_tp_model

        model = replicate_tp_model(model, dims.get_mesh("dp"))
    return model


def mark_distribution_owned(model: nn.Module) -> None:
    """Tell the Trainer that the model owns placement and gradient reduction (no DDP wrap, no re-sharding)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target._is_distributed_loading_by_transformers = True

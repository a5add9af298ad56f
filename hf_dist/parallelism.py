"""Apply a parallel layout to a model (or to one pipeline stage), in one visible order.

``parallelize(model, dims, ...)`` applies, in this order: tensor parallelism over the ``tp`` axis, expert
parallelism over the ``ep`` axis (``hf_dist.expert_parallel``), context parallelism over the ``cp`` axis
(``hf_dist.context_parallel``), activation checkpointing, ``torch.compile`` per block when asked
(``hf_dist.compile``), then data parallelism -- FSDP2 ``fully_shard`` over the data-parallel and context-parallel
axes together (``dp_shard_cp``; HSDP when ``dp_replicate > 1``), or, without FSDP, whole parameters on every rank
with gradients averaged over ``dp x cp`` in buckets, once per optimizer step (``hf_dist.data_parallel.replicate``).
Context-parallel ranks hold different tokens of the same batch, so for the parameters they are data-parallel ranks.
``DistTrainer``, the public API and every pipeline stage (``PipelinedCausalLM``) call it; nothing else in hf_dist
wraps a model (``DistTrainer`` compiles the blocks of the layouts accelerate wraps with the same ``compile_blocks``).

Expert parameters under EP are sharded (FSDP2) or reduced (replicated dp) over the ``efsdp`` ranks that hold the
same experts, not over dp: each expert shard's gradient already sums the contributions of the ``ep`` ranks' batches
(the dispatch brought their tokens), so the sum over ``efsdp`` covers all ``dp`` batches (and, with CP, every cp
rank's slice of them) and is divided by ``dp x cp``, as every other gradient is averaged (transformers'
``apply_fsdp2`` makes the same choice).

The FSDP root -- one decision, made here. During training the root keeps its parameters gathered between forward
and backward (FSDP2's default: backward needs them first), and the blocks follow the request's
``reshard_after_forward``. An input embedding and an lm_head not tied to each other are units of their own
(``_shard_edges``): in the root their whole weights would stay gathered through the step. A forward run without
autograd (evaluation, generation) is followed by no backward to reshard, and while gathered the parameters
registered on a module are the unsharded ones: an optimizer built then (the Trainer builds it in ``train()``, after
any ``evaluate()``) would hold them and update tensors FSDP throws away. So every FSDP unit reshards at the end of
a forward without autograd (``_reshard_after_no_grad_forward``).
``generate`` is a forward of the root too (``_generate_as_forward``): a ``PeftModel`` root's ``generate`` bypasses
its ``forward``, and would otherwise meet sharded embeddings.
``tests/test_parallelize.py`` trains several optimizer steps after an evaluation against one process.

Not here: choosing the layout (``ParallelDims``, the planner), TP plans (``hf_dist.tensor_parallel``), splitting
into pipeline stages (``hf_dist.pipeline_parallel``), or Trainer glue (``hf_dist.trainer``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hf_dist.compile import CompileRequest, compile_blocks
from hf_dist.context_parallel import apply_context_parallel
from hf_dist.data_parallel import replicate
from hf_dist.data_parallel.fsdp_prefetch import reshard_after_forward, set_explicit_prefetch
from hf_dist.expert_parallel import apply_expert_parallel, expert_modules, expert_params
from hf_dist.models.peft_utils import unwrap_peft
from hf_dist.parallel_dims import ParallelDims
from hf_dist.tensor_parallel.apply import apply_tensor_parallel


@dataclass(kw_only=True, frozen=True)
class FsdpRequest:
    """The FSDP2 settings ``parallelize`` applies with ``fully_shard``."""

    reshard_after_forward: bool = True
    """True: FULL_SHARD (ZeRO-3). False: SHARD_GRAD_OP (ZeRO-2-like: parameters stay gathered after forward)."""
    activation_checkpointing: bool = False
    """Checkpoint each wrapped block (recompute in backward)."""
    wrap_classes: tuple[str, ...] | None = None
    """Module class names sharded as units; None: the model's ``_no_split_modules``."""
    cpu_offload: bool = False
    """Keep sharded parameters on CPU (``CPUOffloadPolicy``)."""
    dp_replicate: int = 1
    """Replica groups (HYBRID_SHARD / HSDP): shard inside a group of world / dp_replicate ranks, all-reduce across."""
    dp_shard: int | None = None
    """Ranks a replica shards over, when the launch config states it (checked against the world by ``Layout``)."""
    source: str = "TrainingArguments.fsdp"
    """Where the request came from, for messages."""
    explicit_prefetch: bool = True
    """Each block all-gathers the next one in forward, the previous one in backward; the last block stays gathered
    after forward (``hf_dist.data_parallel.fsdp_prefetch``). False: FSDP2's implicit prefetch only."""
    head_unit: bool = True
    """An untied lm_head is an FSDP unit of its own (``_shard_edges``). False keeps it in the root, gathered through the
    root's forward: for a loss that reads the head's weight outside any forward of the head (TRL's fused LM head)."""

    def as_fields(self) -> dict[str, object]:
        """The ``DistTrainingArguments`` fields that carry this request (the only writer of them)."""
        return {
            "fsdp2": True,
            "fsdp2_reshard_after_forward": self.reshard_after_forward,
            "fsdp2_activation_checkpointing": self.activation_checkpointing,
            "fsdp2_wrap_classes": list(self.wrap_classes) if self.wrap_classes else None,
            "fsdp2_cpu_offload": self.cpu_offload,
            "fsdp2_dp_replicate": self.dp_replicate,
            "fsdp2_dp_shard": self.dp_shard,
        }

    @classmethod
    def from_fields(cls, args) -> FsdpRequest | None:
        """The request carried by ``args``' ``fsdp2*`` fields (``launch_env`` reads only the on/off
        ``fsdp2`` flag); None without ``fsdp2``."""
        if not getattr(args, "fsdp2", False):
            return None
        return cls(
            reshard_after_forward=args.fsdp2_reshard_after_forward,
            activation_checkpointing=args.fsdp2_activation_checkpointing,
            wrap_classes=tuple(args.fsdp2_wrap_classes) if args.fsdp2_wrap_classes else None,
            cpu_offload=args.fsdp2_cpu_offload,
            dp_replicate=args.fsdp2_dp_replicate,
            dp_shard=getattr(args, "fsdp2_dp_shard", None),
            source="DistTrainingArguments.fsdp2",
            explicit_prefetch=getattr(args, "fsdp2_explicit_prefetch", True),
            head_unit=not getattr(args, "reads_lm_head_weight", False),
        )


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    fsdp: FsdpRequest | bool | None = None,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    tp_plan: dict | None = None,
    fsdp_units: Sequence[nn.Module] | None = None,
    grad_reduction: Literal["mean", "sum"] = "mean",
    replicate_gradients: bool = True,
    compile_request: CompileRequest | None = None,
) -> nn.Module:
    """Apply TP, then EP, then activation checkpointing, then per-block compile, then FSDP2 or replicated DP, in
    place.

    Args:
        model: an HF causal LM (optionally a ``PeftModel``) or a pipeline stage, identical on every rank, on its
            device. ``dims.build_mesh()`` must have been called.
        fsdp: shard over the data-parallel axes with these settings (``True``: ``FsdpRequest()``); ``None``/``False``:
            with ``dims.dp > 1``, keep whole parameters on every dp rank and average gradients (``replicate``).
        activation_checkpointing: recompute each decoder layer in backward (also when ``fsdp`` asks for it).
        param_dtype: FSDP mixed precision: compute in this dtype, reduce gradients in fp32.
        sequence_parallel, vocab_parallel, tp_plan: as in ``hf_dist.tensor_parallel.apply_tensor_parallel``.
        fsdp_units: the blocks FSDP shards (and ``compile_request`` compiles) one by one before the root (a
            pipeline stage's own decoder layers); default: the request's ``wrap_classes`` or ``_no_split_modules``.
        grad_reduction: ``"sum"`` sums FSDP gradients over dp instead of averaging them (a pipeline divides its loss
            by the tokens of the whole global batch already).
        replicate_gradients: False leaves gradient reduction of replicated (non-FSDP) dp to the caller (the pipeline
            all-reduces once per step: zero-bubble schedules write ``.grad`` past per-parameter hooks).
        compile_request: ``torch.compile`` each block in place (``hf_dist.compile``); None: eager.
    """
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction={grad_reduction!r} must be 'mean' or 'sum'")
    request = FsdpRequest() if fsdp is True else fsdp or None
    if dims.tp_enabled:
        model = apply_tensor_parallel(
            model, dims.get_mesh("tp"), plan=tp_plan, sequence_parallel=sequence_parallel,
            vocab_parallel=vocab_parallel, split_experts=not dims.ep_enabled,
        )
    if dims.ep_enabled:
        apply_expert_parallel(model, dims)
        if request is None:  # FSDP2's generate steps in sync already (``_generate_as_forward``)
            _generate_in_step(model)
    if dims.cp_enabled:
        apply_context_parallel(model, dims.get_mesh("cp").get_group(), find_blocks(model))
    if activation_checkpointing or (request is not None and request.activation_checkpointing):
        apply_activation_checkpointing(model)
    if compile_request is not None:
        blocks = fsdp_units if fsdp_units is not None else find_blocks(model, request and request.wrap_classes)
        compile_blocks(blocks, compile_request)
    if request is not None:
        model = apply_fsdp(
            model, dims, request, units=fsdp_units, param_dtype=param_dtype, grad_reduction=grad_reduction
        )
    elif dims.dp_cp > 1 and replicate_gradients:
        if grad_reduction != "mean":
            raise ValueError("grad_reduction='sum' with replicated data parallelism: reduce the gradients yourself "
                             "(replicate_gradients=False) or use FSDP")
        experts = (expert_params, dims.get_mesh("efsdp"), dims.dp_cp) if dims.ep_enabled else None
        model = replicate(model, dims.get_mesh("dp_cp"), experts=experts)
    return model


def find_blocks(model: nn.Module, class_names: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The transformer blocks to shard as units: ``class_names`` or the model's ``_no_split_modules``."""
    if class_names is None:
        names = getattr(model, "_no_split_modules", None) or getattr(unwrap_peft(model), "_no_split_modules", None)
        class_names = tuple(names or ())
    blocks = [m for m in model.modules() if type(m).__name__ in class_names]
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"no module of class {list(class_names)} in {type(model).__name__}, so FSDP would shard the whole model "
            f"as one unit; set the wrap class (fsdp_transformer_layer_cls_to_wrap) to one of: {present}"
        )
    return blocks


def fsdp_mesh(dims: ParallelDims):
    """The mesh FSDP2 shards over: ``dp_shard`` (x ``cp``: ``dp_shard_cp``), or the 2-D ``(dp_replicate, dp_shard)``
    mesh for HSDP (not with CP: ``Layout`` refuses HSDP x CP)."""
    return dims.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else dims.get_mesh("dp_shard_cp")


def apply_fsdp(
    model: nn.Module,
    dims: ParallelDims,
    request: FsdpRequest,
    *,
    units: Sequence[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    grad_reduction: Literal["mean", "sum"] = "mean",
) -> nn.Module:
    """``fully_shard`` every block, then the root (kept gathered in training; see the module docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None
    )
    if request.cpu_offload and not torch.accelerator.is_available():
        raise ValueError("fsdp2_cpu_offload=True (fsdp offload_params) on a machine without a GPU: FSDP2's CPU offload "
                         "copies each shard to the accelerator for compute and fails without one; drop the offload "
                         "(the parameters are in CPU memory already)")
    offload = CPUOffloadPolicy() if request.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=fsdp_mesh(dims), mp_policy=mp_policy, offload_policy=offload)
    whole_model = units is None  # not a pipeline stage, whose root holds what its stage has of the edges
    units = list(units) if units is not None else find_blocks(model, request.wrap_classes)
    for experts in expert_modules(model):  # first: each block then leaves the experts' parameters to them
        _shard_experts(experts, dims, request, kwargs, grad_reduction)
    for i, block in enumerate(units):
        reshard = reshard_after_forward(i, len(units), requested=request.reshard_after_forward,
                                        explicit_prefetch=request.explicit_prefetch)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    edges = _shard_edges(model, request, kwargs) if whole_model else []
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if request.explicit_prefetch:
        set_explicit_prefetch(units)
    if grad_reduction == "sum":
        for unit in (*units, *edges, model):  # per unit: a unit's settings do not reach the units inside it
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    model.register_forward_hook(_reshard_after_no_grad_forward)
    _generate_as_forward(model)
    _keep_class_name(model)
    return model


def _shard_edges(model: nn.Module, request: FsdpRequest, kwargs: dict) -> list[nn.Module]:
    """The input embedding and the lm_head as FSDP units of their own, where they are not tied to each other.

    In the root, their whole weights would stay gathered from the start of forward to the end of backward, and their
    gradients would wait for the root's reduce-scatter. As a unit the embedding is freed after forward
    (``request.reshard_after_forward``), gathered again for its backward and reduced on its own; the head, the last
    forward and the first backward, stays gathered between the two (``reshard_after_forward=False``) and is reduced
    right after its backward. transformers' own FSDP plan frees and reduces them the same way. The chunked loss reads
    the head's weight outside its ``forward``, so it runs as a registered forward method of the head's unit
    (``hf_dist.loss.chunked.gather_head_for_loss``). A head that TRL's fused LM head reads directly stays in the root
    (``request.head_unit``), as does a tied pair: one Parameter, which one unit must own.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from hf_dist.loss.chunked import gather_head_for_loss

    base = unwrap_peft(model)
    try:
        embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return []
    weight, head_weight = getattr(embed, "weight", None), getattr(head, "weight", None)
    if weight is None or weight is head_weight:
        return []
    edges = []
    if isinstance(embed, nn.Module) and not isinstance(embed, FSDPModule):
        fully_shard(embed, reshard_after_forward=request.reshard_after_forward, **kwargs)
        edges.append(embed)
    if (request.head_unit and isinstance(head, nn.Module) and not isinstance(head, FSDPModule)
            and isinstance(head_weight, nn.Parameter)):
        fully_shard(head, reshard_after_forward=False, **kwargs)
        gather_head_for_loss(head)
        edges.append(head)
    return edges


def _keep_class_name(model: nn.Module) -> None:
    """``model._get_name()`` stays the model's own class name (``LlamaForCausalLM``), not FSDP2's ``FSDP...`` class.

    ``fully_shard`` swaps the root's class for a subclass named ``FSDP<name>``; the Trainer decides by that name
    whether a label smoother shifts the labels (causal LMs do), so without this label smoothing under FSDP2 compared
    each token's logits with its own label instead of the next one's."""
    from torch.distributed.fsdp import FSDPModule

    name = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule)).__name__
    model._get_name = lambda: name


def _shard_experts(experts: nn.Module, dims: ParallelDims, request: FsdpRequest, kwargs: dict,
                   grad_reduction: str) -> None:
    """FSDP2 of one experts module over the ``efsdp`` ranks (HSDP: sharded inside each replica group, reduced across),
    its gradient summed there and divided by ``dp x cp``
    (``grad_reduction="mean"``) or left summed (``"sum"``: a pipeline's loss is divided by the global batch's tokens
    already). Either way the token exchange has brought every ``ep`` peer's share into the sum."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(experts, reshard_after_forward=request.reshard_after_forward,
                **(kwargs | {"mesh": dims.expert_fsdp_mesh()}))
    experts.set_gradient_divide_factor(float(dims.dp_cp) if grad_reduction == "mean" else 1.0)
    # A divisor other than the group's size is PREMUL_SUM, which gloo lacks: sum, divide locally. Not with a 1-rank
    # shard group (HSDP, ep = the replica group): torch 2.13's FSDP2 then divides in its copy in place of the
    # reduce-scatter and again after the all-reduce (the gradient divided by the factor squared); without the forced
    # sum it divides once and all-reduces with SUM.
    if dims.efsdp // dims.expert_replicas > 1:
        experts.set_force_sum_reduction_for_comms(True)


def _reshard_after_no_grad_forward(module: nn.Module, args, output):
    """Without autograd no backward follows to reshard: do it now, so the registered parameters are the shards."""
    if not torch.is_grad_enabled():
        _reshard_units(module)
    return output


def _reshard_units(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _generate_as_forward(model: nn.Module) -> None:
    """Make ``model.generate`` gather the root's parameters (embeddings, norm, head) as its forward does.

    FSDP gathers them in the root's ``forward``; a ``PeftModel`` root's ``generate`` calls the wrapped HF model's
    ``generate``, which never passes through the root's forward, so the embedding would meet sharded weights.
    torch's ``register_fsdp_forward_method`` runs the root's pre/post-forward around ``generate``; every unit is
    resharded after it (no backward follows). A plain HF root's forward inside it gathers and reshards as before.
    Each block's gather is a collective, so every rank keeps stepping until all ranks' sequences are done
    (``synced_gpus``, which transformers turns on only for FSDP it recognises by its own flag); a rank that stopped
    at its own end of sequence would leave the others waiting in a gather.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not callable(getattr(model, "generate", None)):
        return
    register_fsdp_forward_method(model, "generate")
    gathered_generate = model.generate

    @functools.wraps(gathered_generate)
    def generate(*args, **kwargs):
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            kwargs.setdefault("synced_gpus", True)
        try:
            with torch.no_grad():
                return gathered_generate(*args, **kwargs)
        finally:
            _reshard_units(model)

    model.generate = generate


def _generate_in_step(model: nn.Module) -> None:
    """Make ``model.generate`` keep stepping on every rank until all ranks are done (``synced_gpus``).

    Under expert parallelism every forward exchanges tokens with the ``ep`` peers (an all-to-all), so a rank whose
    sequences all ended would leave its peers waiting in the exchange; transformers turns ``synced_gpus`` on only
    for DeepSpeed ZeRO-3 and its own FSDP. A finished rank runs forwards whose tokens it discards, as under FSDP2."""
    if not callable(getattr(model, "generate", None)):
        return
    own_generate = model.generate

    @functools.wraps(own_generate)
    def generate(*args, **kwargs):
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            kwargs.setdefault("synced_gpus", True)
        return own_generate(*args, **kwargs)

    model.generate = generate


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant, which composes with DTensor and FSDP2)."""
    target = unwrap_peft(model)
    target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    frozen_inputs = not any(p.requires_grad for p in target.get_input_embeddings().parameters())
    if hasattr(model, "enable_input_require_grads") and frozen_inputs:
        model.enable_input_require_grads()  # LoRA on a frozen base: checkpointed blocks need a grad-requiring input

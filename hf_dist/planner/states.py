"""Model states and communication buffers of one rank: parameters, master copy, gradients, Adam, buckets.

Counts are exact per tensor: every parameter this rank holds (after TP/PP splitting) is listed with its
shape and sharded the way each framework shards it. TP splits column-parallel linears on dim 0, row-parallel
ones on dim 1, the embedding only under ``vocab_parallel``, and the lm_head on the vocabulary where training
does (``lm_head_tp``: untied with the vocabulary divisible by tp, or ``vocab_parallel``); a tied lm_head stays
whole with its embedding. Then:
  * FSDP2 (``fully_shard``): each tensor split on dim 0 into ``ceil(d0 / S)`` rows; rank 0 holds the most.
  * DeepSpeed ZeRO-1/2: one flat group per optimizer param group, each parameter padded to 16 bytes and the
    group to a multiple of ``2 x S`` elements (its NCCL alignment), split evenly.
  * DeepSpeed ZeRO-3: each parameter partitioned on its own, ``ceil(numel / S)`` elements.
Adam keeps two fp32 moments per trainable element and one fp32 ``step`` scalar per tensor it owns (torch) or
per flat group (DeepSpeed). DeepSpeed always keeps an fp32 master partition (a clone, even in fp32 training).

Assumptions, by strategy (``p`` = module parameter bytes, ``g`` = gradient bytes):
  * DDP: full parameters and gradients, and the reducer's bucket buffers, a second copy of the gradients
    (``gradient_as_bucket_view=False``, the accelerate/Trainer default).
  * FSDP2: fp32 shards of parameters and gradients (the shard is the master; ``pure_bf16``: bf16 shards and
    bf16 Adam states), Adam over the shards; during
    forward/backward one layer unit gathered plus ``prefetch`` units ahead (``limit_all_gathers`` /
    FSDP2's default of one), and the last layer kept gathered from its forward to its backward (explicit prefetch).
    The root (final norm; with a tied head the embedding too) stays gathered from forward to the end of backward;
    an untied embedding and lm_head are units of their own (``hf_dist.parallelism._shard_edges``; not in a
    pipeline stage, whose root holds them): the embedding freed after forward and prefetched again by the first
    layer's backward, the head gathered from its forward to its backward and its gradient reduced right after. In
    the root the head's (tied: the embedding's) unsharded gradient waits for the root's reduce-scatter at the end.
    The unit's reduce-scatter input is a separate fp32 buffer (``reduce_dtype=float32``) the gradients are copied
    into before they are freed, so both are alive at once. SHARD_GRAD_OP keeps every unit gathered between forward
    and backward. Traced against the CPU allocator on 2 gloo ranks (``tests/test_planner_peak_dist.py``).
  * ZeRO: ``reduce_bucket_size = h²`` and ``stage3_prefetch_bucket_size = 0.9 h²`` (the Trainer's "auto");
    stage 1/2 double-buffer the reduce bucket (``overlap_comm``); stage 3 holds the largest linear being
    used, the prefetch bucket and parameters under ``10 h`` elements (persistent). The optimizer step builds
    an fp32 gradient copy per sub-group: ZeRO-1/2 the whole partition, ZeRO-3 at most ``sub_group_size``
    (1e9, DeepSpeed's default and hf_dist's generated configs) elements.
  * LoRA: the frozen base is stored in bf16 (fp32 when precision is fp32) with no gradient or optimizer
    state; adapters are fp32 and trained with Adam.
  * Offload ``cpu``/``nvme``: master copy, Adam and fp32 gradients leave the GPU (ZeRO-3 and FSDP: parameter
    shards too; ``cpu_optimizer``: ZeRO-3 keeps its parameters on the GPU); ``cpu_bytes``/``nvme_bytes`` say
    what lands there per rank: DeepSpeed's 16 bytes/parameter (ZeRO-1/2) and 18 (ZeRO-3 with parameters), the
    figures its own estimators use.

Not here: activations (``activations.py``) or the phase-by-phase peak (``memory.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

from hf_dist.planner.catalogue import ModelSpec, spec_config
from hf_dist.planner.workload import FSDP_STRATEGIES, Layout, Workload
from hf_dist.precision import itemsize, tensor_dtypes
from hf_dist.tensor_parallel.plans import lm_head_split

ZERO3_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed's ``sub_group_size`` default, which ``hf_dist.configs`` writes."""

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


@dataclass(kw_only=True, frozen=True)
class ModelStates:
    """Bytes of the model states one rank keeps on the GPU, and what it offloads."""

    parameters: int
    """Parameters as the module stores them (sharded for FSDP/ZeRO-3; frozen base and adapters for LoRA)."""
    master_params: int
    """A separate fp32 master copy (DeepSpeed); 0 where the fp32 parameters are the master."""
    gradients: int
    """Gradients kept between backward and the optimizer step."""
    optimizer_states: int
    """Adam exp_avg and exp_avg_sq in fp32, plus the step counters."""
    comm_buffers: int
    """DDP reducer buckets, DeepSpeed reduce buckets."""
    gathered_at_loss: int
    """Gathered parameters alive when forward ends: FSDP's root unit (SHARD_GRAD_OP: every unit)."""
    gathered_in_backward: int
    """Gathered parameters alive in backward: the unit, the one prefetched, the root (ZeRO-3: working set)."""
    unsharded_grads: int
    """Gradients of the unit in backward before reduce-scatter, and the root's lm_head gradient."""
    optimizer_step_temp: int
    """Temporaries of the optimizer step: none for torch's fused AdamW (the Trainer's default); DeepSpeed
    builds an fp32 copy of its gradient partition for the step."""
    cpu_bytes: int = 0
    """Offloaded to CPU memory by this rank."""
    nvme_bytes: int = 0
    """Offloaded to NVMe by this rank."""
    largest_transient: int = 0
    """The largest single transient buffer: a gathered unit, a reduce-scatter input, a bucket."""
    last_gather_buffer: int = 0
    """FSDP2's buffer of forward's last all-gather, kept (``AllGatherState``) until the next all-gather or the root's
    post-forward: the head's unit where it is one, else the last decoder layer. A loss computed inside the root's
    forward (the chunked loss) peaks while it is alive."""
    head_gradients: int = 0
    """Gradients made before the first decoder layer's backward: the untied lm_head's (a tied head's: the
    embedding's), as this rank keeps them (``memory.gradients_kept`` says when the rest do not exist yet)."""



@functools.lru_cache(maxsize=None)
def lm_head_tp(model: ModelSpec, tp: int, vocab_parallel: bool) -> int:
    """Ranks the lm_head weight is split over on the vocabulary (1: whole on every TP rank), as training
    splits it (``hf_dist.tensor_parallel.plans.lm_head_split``)."""
    if tp <= 1:
        return 1
    return tp if lm_head_split(spec_config(model), tp, vocab_parallel=vocab_parallel) else 1


def local_param_shapes(model: ModelSpec, layout: Layout, *, layers: int, first: bool, last: bool):
    """``(name, shape)`` of the base parameters one TP rank of one pipeline stage holds."""
    t, ep = layout.dims.tp, layout.ep
    vocab_t = t if layout.vocab_parallel else 1
    head_t = lm_head_tp(model, t, layout.vocab_parallel)
    if first:
        yield "embed_tokens", (model.vocab_size // vocab_t, model.hidden_size)
    for _ in range(layers):
        for name, shape in model.layer_param_shapes():
            module = name.split(".")[0]
            if module in _COLWISE:
                shape = (shape[0] // t, *shape[1:])
            elif module in _ROWWISE and len(shape) == 2:  # a row-parallel bias (gpt-oss o_proj) stays whole
                shape = (shape[0], shape[1] // t)
            elif name.startswith("mlp.experts."):  # expert parallelism: E / ep experts on this rank
                shape = (shape[0] // ep, *shape[1:])
            yield name, shape
    if last:
        yield "norm", (model.hidden_size,)
        if not model.tie_word_embeddings or not first:
            yield "lm_head", (model.vocab_size // head_t, model.hidden_size)


def lora_shapes(model: ModelSpec, rank: int, layers: int):
    for _ in range(layers):
        for name, (fan_in, fan_out) in model.linear_shapes().items():
            yield f"{name}.lora_A", (rank, fan_in)
            yield f"{name}.lora_B", (fan_out, rank)


def _numel(shape) -> int:
    return math.prod(shape)


def shard_elements(shapes: list[tuple[int, ...]], shards: int, how: str) -> int:
    """Elements rank 0 holds when ``shapes`` are sharded ``shards`` ways (``fsdp2``, ``ds_flat``, ``ds_param``)."""
    if shards == 1:
        return sum(_numel(s) for s in shapes)
    if how == "fsdp2":
        return sum(math.ceil(s[0] / shards) * _numel(s[1:]) for s in shapes)
    if how == "ds_param":
        return sum(math.ceil(_numel(s) / shards) for s in shapes)
    padded = sum(_numel(s) + (-_numel(s)) % 4 for s in shapes)
    return math.ceil(padded / (2 * shards)) * 2


def _ds_partition_overlap(shapes: list[tuple[int, ...]], partition: int) -> int:
    """Elements of the parameters that start inside rank 0's flat partition (16-byte aligned offsets)."""
    offset = total = 0
    for shape in shapes:
        if offset >= partition:
            break
        total += _numel(shape)
        offset += _numel(shape) + (-_numel(shape)) % 4
    return total


def gathered_itemsize(workload: Workload, layout: Layout) -> int:
    """Bytes per element of gathered units: FSDP gathers the stored dtype unless it casts (bf16_mixed/LoRA)."""
    if workload.precision != "fp32" and layout.lora_rank:
        return 2
    return itemsize(tensor_dtypes(layout, workload.precision).gathered)


def model_states(model: ModelSpec, workload: Workload, layout: Layout, *, layers: int, first: bool = True,
                 last: bool = True) -> ModelStates:
    """The model states and buffers of one rank of ``layout`` holding ``layers`` decoder layers."""
    base = list(local_param_shapes(model, layout, layers=layers, first=first, last=last))
    adapters = list(lora_shapes(model, layout.lora_rank, layers)) if layout.lora_rank else []
    trainable = [s for _, s in (adapters or base)]
    frozen = [s for _, s in base] if adapters else []
    if model.is_moe and layout.ep > 1:  # without EP, experts are sharded like any other parameter
        return _moe_torch(model, workload, layout, base, adapters, layers=layers, first=first, last=last)
    unit = [s for _, s in local_param_shapes(model, layout, layers=1, first=False, last=False)]
    root = [s for n, s in base if n in ("embed_tokens", "norm", "lm_head")]
    if layout.is_deepspeed:
        return _deepspeed(model, workload, layout, trainable, frozen, unit, root)
    return _torch(workload, layout, trainable, frozen, unit, _edges(base, layout, workload))


@dataclass(frozen=True)
class _Edges:
    """The parameters outside the decoder layers, as FSDP2 groups them (``hf_dist.parallelism._shard_edges``)."""

    embed: list
    norm: list
    lm_head: list
    """Empty where the head is tied to the embedding (one weight: ``embed``) or on another pipeline stage."""
    embed_unit: bool
    """The untied embedding is an FSDP unit of its own (whole model, no pipeline): freed after forward, gathered again
    for its backward; else it stays in the root, gathered through the step, its gradient reduced at the end."""
    head_unit: bool = False
    """The untied head is a unit of its own too (``Workload.head_unit``: not under TRL's trainers, whose fused LM head
    reads its weight in the root's forward): gathered from its forward to its backward, its gradient reduced right
    after; else it stays in the root like the embedding would."""

    @property
    def root(self) -> list:
        return self.norm + ([] if self.embed_unit else self.embed) + ([] if self.head_unit else self.lm_head)


def _edges(base, layout, workload) -> _Edges:
    embed = [s for n, s in base if n == "embed_tokens"]
    lm_head = [s for n, s in base if n == "lm_head"]
    norm = [s for n, s in base if n == "norm"]
    units = layout.dims.pp == 1 and bool(embed) and bool(lm_head)
    return _Edges(embed=embed, norm=norm, lm_head=lm_head, embed_unit=units, head_unit=units and workload.head_unit)


NO_EDGES = _Edges(embed=[], norm=[], lm_head=[], embed_unit=False)


def _sharded_terms(workload, layout, edges: _Edges, unit_el: int, gathered: list, trained: bool,
                   keep_last_unit: bool) -> tuple[int, int, int, int]:
    """FULL_SHARD / HYBRID_SHARD: bytes gathered when forward ends and in backward, and unsharded gradients.

    When forward ends: the root, the head's unit, and the last decoder layer (``keep_last_unit``: with explicit
    prefetch, ``hf_dist.data_parallel.fsdp_prefetch``, the last block is not resharded after forward, backward needs it
    first). In backward: the unit in backward, the one prefetched (the embedding's unit, prefetched by the first
    layer, where it is one) and the root. Unsharded gradients: the unit's and its fp32 reduce-scatter input; in the
    root, the head's (the tied weight's) gradient, made by the first backward and reduced at the end. Last, the
    buffer of forward's last all-gather (``ModelStates.last_gather_buffer``)."""
    def n(shapes: list) -> int:
        return sum(_numel(x) for x in shapes)

    gb, rb = gathered_itemsize(workload, layout), itemsize(tensor_dtypes(layout, workload.precision).reduction)
    if layout.strategy == "fsdp_shard_grad_op":  # every unit gathered from forward to backward
        at_loss = in_backward = gb * n(gathered)
    else:
        last = unit_el if keep_last_unit else 0
        head_unit = n(edges.lm_head) if edges.head_unit else 0
        at_loss = gb * (n(edges.root) + head_unit + last)
        prefetched = max(unit_el, n(edges.embed)) if edges.embed_unit else unit_el
        in_backward = gb * (unit_el + prefetched + n(edges.root))
    last_buffer = gb * (n(edges.lm_head) if edges.head_unit else unit_el)
    unsharded = 0
    if trained:
        head_in_root = 0 if edges.head_unit else n(edges.lm_head) or (n(edges.embed) if edges.norm else 0)  # tied
        unsharded = (gb + rb) * unit_el + gb * head_in_root
    return at_loss, in_backward, unsharded, last_buffer


def _torch(workload, layout, trainable, frozen, unit, edges: _Edges, keep_last_unit: bool = True) -> ModelStates:
    s = layout.shard_degree
    sharded = layout.strategy in FSDP_STRATEGIES
    train_el = shard_elements(trainable, s, "fsdp2")
    frozen_bytes = (4 if workload.precision == "fp32" else 2) * shard_elements(frozen, s, "fsdp2")
    dtypes = tensor_dtypes(layout, workload.precision)  # trainable parameter, gradient and Adam-moment bytes
    w, g, o = itemsize(dtypes.parameters), itemsize(dtypes.gradients), itemsize(dtypes.optimizer_states)
    if layout.strategy == "ddp" and workload.precision == "bf16_mixed" and not frozen:
        params, master, grads = 2 * train_el, 4 * train_el, 2 * train_el
    else:
        params, master, grads = w * train_el + frozen_bytes, 0, g * train_el
    optim = 2 * o * train_el + 4 * len(trainable)
    gb = gathered_itemsize(workload, layout)
    at_loss = in_backward = unsharded = last_buffer = 0
    if sharded:
        unit_el = sum(_numel(x) for x in unit)
        at_loss, in_backward, unsharded, last_buffer = _sharded_terms(workload, layout, edges, unit_el,
                                                                      frozen or trainable, not frozen, keep_last_unit)
    buckets = grads if layout.strategy == "ddp" and layout.dims.dp > 1 else 0  # one process: no reducer
    step_temp = 0  # fused AdamW (the Trainer's default, adamw_torch_fused) updates in place
    cpu = 0
    if layout.offload == "cpu":
        cpu = params + grads + optim
        params = grads = optim = step_temp = 0
    # the head's gradient before the first layer's backward: sharded where the head is a unit of its own; in FSDP's
    # root it is unsharded until the end (``unsharded_grads``); whole under DDP (a tied head's: the embedding's)
    head = edges.lm_head or (edges.embed if edges.norm else [])
    head_grads = 0 if frozen or layout.offload == "cpu" or (sharded and not edges.head_unit) else (
        g * shard_elements(head, s, "fsdp2"))
    largest = 0
    if sharded:
        largest = max(gb, 4) * sum(_numel(x) for x in unit)
        if layout.strategy == "fsdp_shard_grad_op":
            largest = max(largest, gb * sum(_numel(x) for x in edges.embed + edges.norm + edges.lm_head))
    return ModelStates(parameters=params, master_params=master, gradients=grads, optimizer_states=optim,
                       comm_buffers=buckets, gathered_at_loss=at_loss, gathered_in_backward=in_backward,
                       unsharded_grads=unsharded, optimizer_step_temp=step_temp, cpu_bytes=cpu,
                       largest_transient=largest, last_gather_buffer=last_buffer, head_gradients=head_grads)


def _expert(name: str) -> bool:
    return name.startswith("mlp.experts.")


def _moe_torch(model, workload, layout, base, adapters, *, layers, first, last) -> ModelStates:
    """A MoE under EP x DDP or EP x FSDP2 (``Layout`` refuses EP with anything else): the dense parameters as
    ``_torch`` counts them over the data-parallel shards, the routed experts (``E / ep`` per rank) over the
    expert-FSDP shards (``efsdp = dp x cp x tp / ep``; 1 under DDP, which replicates them), then the two added.
    FSDP2 shards on dim 0: ``E / ep`` experts over more than ``E / ep`` ranks leave some ranks padding."""
    experts = [s for n, s in base if _expert(n)]
    dense = [(n, s) for n, s in base if not _expert(n)]
    unit_all = list(local_param_shapes(model, layout, layers=1, first=False, last=False))
    unit_dense = [s for n, s in unit_all if not _expert(n)]
    unit_experts = [s for n, s in unit_all if _expert(n)]
    dense_trainable = [s for _, s in (adapters or dense)]
    part = _torch(workload, layout, dense_trainable, [s for _, s in dense] if adapters else [], unit_dense,
                  _edges(dense, layout, workload))
    expert_layout = replace(layout, num_gpus=layout.efsdp, num_nodes=1, ep=1, tp=1, pp=1, cp=1)
    # each layer's experts are a unit of their own, resharded after forward (the last layer's too)
    expert = _torch(workload, expert_layout, [] if adapters else experts, experts if adapters else [],
                    unit_experts, NO_EDGES, keep_last_unit=False)
    sums = {f.name: getattr(part, f.name) + getattr(expert, f.name) for f in fields(ModelStates)}
    sums["largest_transient"] = max(part.largest_transient, expert.largest_transient)
    return ModelStates(**sums)


def _deepspeed(model, workload, layout, trainable, frozen, unit, root) -> ModelStates:
    s, stage, h = layout.shard_degree, int(layout.strategy[-1]), model.hidden_size
    p = 4 if workload.precision == "fp32" else 2
    part_el = shard_elements(trainable, s, "ds_param" if stage == 3 else "ds_flat")
    if stage == 3:
        params = p * (part_el + shard_elements(frozen, s, "ds_param"))
    else:  # the whole padded flat buffer, which the module's parameters are views of
        params = p * (s * part_el + sum(_numel(x) for x in frozen))
    if stage == 1:
        grads = p * sum(_numel(x) for x in trainable)
    else:  # stage 2 buffers whole gradients of the parameters touching rank 0's partition; stage 3 the partition
        grads = p * (_ds_partition_overlap(trainable, part_el) if stage == 2 else part_el)
    master, optim = 4 * part_el, 8 * part_el + 4
    buckets = p * h * h * (2 if stage < 3 else 1)
    at_loss = in_backward = unsharded = 0
    if stage == 3:  # the largest module in use (often lm_head), the prefetch bucket, persistent small params
        largest = max(_numel(x) for x in unit + root)
        persistent = sum(_numel(x) for x in unit if _numel(x) <= 10 * h) * model.num_hidden_layers
        unsharded = p * largest
        at_loss = in_backward = p * (largest + int(0.9 * h * h) + persistent)
    # the fp32 copy of the gradients DeepSpeed hands its optimizer, one sub-group at a time at ZeRO-3
    step_temp = 4 * (min(part_el, ZERO3_SUB_GROUP_SIZE) if stage == 3 else part_el)
    cpu = nvme = 0
    if layout.offload != "none":
        off_params = params if stage == 3 and layout.offload != "cpu_optimizer" else 0
        fp32_grads = 4 * part_el  # the optimizer steps on CPU with an fp32 gradient partition
        if layout.offload in ("cpu", "cpu_optimizer"):
            cpu = master + optim + fp32_grads + off_params
        else:  # ZeRO-Infinity: master, Adam and parameters on NVMe, gradients through CPU memory
            nvme, cpu = master + optim + off_params, fp32_grads
        grads = master = optim = step_temp = 0
        params -= off_params
    return ModelStates(parameters=params, master_params=master, gradients=grads, optimizer_states=optim,
                       comm_buffers=buckets, gathered_at_loss=at_loss, gathered_in_backward=in_backward,
                       unsharded_grads=unsharded, optimizer_step_temp=step_temp, cpu_bytes=cpu, nvme_bytes=nvme,
                       largest_transient=max(unsharded, p * h * h))

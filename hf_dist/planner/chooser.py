"""Choose a layout: the fastest that fits, with a reason for every other.

Every layout below is evaluated: memory (does it fit?) and step time, compute plus communication
(``throughput.py``: FLOPs over the peak and efficiency, and the ledger minimum's bytes over the links). The chosen
layout is the first in the decision table below whose step is within ``CHOICE_MARGIN`` (5 %) of the fastest that
fits: a smaller difference is inside the forecast's error, so the table's order (least communication first, native
before DeepSpeed) decides it. The table, least communication first:

  0. DDP (gradients all-reduced once per step)
  1. ZeRO-1 (same traffic, optimizer states sharded)
  2. FSDP SHARD_GRAD_OP, ZeRO-2 (gradients reduce-scattered, parameters gathered once per step)
  3. FSDP HYBRID_SHARD (multi-node only: FULL_SHARD inside a node, replicas across nodes)
  4. FSDP FULL_SHARD, ZeRO-3 (parameters gathered every forward and backward)
  5. TP inside a node (2, 4, 8) on top of FULL_SHARD, with sequence parallel (all-reduces in every layer)
  6. PP (across nodes first), on top of FULL_SHARD, and of TP over the whole node
  7. Offload: ZeRO-2 optimizer to CPU, ZeRO-3 optimizer only, FSDP parameters + optimizer, ZeRO-3 optimizer +
     parameters to CPU, then to NVMe (every one checked against the node's host RAM)
  8. Context parallelism (2, 4, 8, ... up to the world) on top of FULL_SHARD: each sequence split over cp ranks
     (all-to-alls of q/k/v/output per layer, timed like every collective) -- what fits when one sequence's
     activations do not fit a GPU whatever the sharding
Within a tier FSDP comes before DeepSpeed (native, and the case study's choice). For a MoE model
(``ModelSpec.is_moe``) expert parallelism comes first in tiers 0 and 2, the largest ``ep`` (8, 4, 2, inside a node)
first (and beside TP, PP and CP in tiers 5, 6 and 8): EP x DDP all-reduces expert gradients over
``efsdp = dp / ep`` ranks only, and EP x FSDP2 (FULL_SHARD)
gathers and reduce-scatters only the dense parameters and the experts over ``efsdp`` (none at ``ep = dp``) while the
tokens travel (dispatch and combine all-to-alls of ``N·k·h``, timed), where layouts without EP move every expert's
weights or gradients once per step or more. Only layouts ``hf_dist.strategy.Layout`` accepts are offered (EP with
FSDP2 FULL_SHARD or DDP; EP x TP without sequence parallelism); a model type the registry has not proven for a
product (``ep_tp``, ``ep_pp``, ``ep_cp``) shows the run's refusal as its rule. With ``lora=True`` every layout is also tried with LoRA adapters on a frozen base, and
LoRA layouts are preferred when one fits.

A layout fits when its ``MemoryBreakdown.fit_bytes`` (in use: reserved plus context and NCCL, plus the largest
transient allocation) is at most ``(1 - safety_margin)`` of the GPU's memory and what it offloads fits the
node's host RAM (``host.py``); a loading peak over the host RAM is a warning. Each layout is evaluated in the
precision it will run (``hf_dist.precision.precision_that_runs``). Layouts the batch contract or the model's
TP shape (``hf_dist.support.model_refusals``, the rules training applies) rule out are rejected
with the rule's message.

Not here: the memory or time arithmetic (``memory.py``, ``throughput.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from hf_dist.batch import BatchContract
from hf_dist.loss.policy import layout_refusal
from hf_dist.planner.catalogue import GpuSpec, ModelSpec, spec_config
from hf_dist.planner.communication import Links
from hf_dist.planner.host import HostMemory, Loading, host_memory
from hf_dist.planner.workload import Attention, Layout, Workload, make_layout
from hf_dist.planner.memory import MemoryAssumptions, MemoryBreakdown, estimate_memory, gib
from hf_dist.planner.throughput import Throughput, estimate_throughput
from hf_dist.precision import MIXED_PRECISIONS, MixedPrecision, precision_that_runs
from hf_dist.tensor_parallel.checks import check_tp_sizes
from hf_dist.trl_support import TRL_TRAINERS, trainer_layout_refusal

TRAINERS = ("sft", *TRL_TRAINERS)
GRPO_DEFAULTS = {"num_generations": 8, "beta": 0.0}
"""TRL's ``GRPOConfig`` defaults the planner assumes (``tests/test_planner_trainers.py`` reads them off TRL): with
``beta = 0`` GRPO loads no reference model."""


@dataclass(kw_only=True, frozen=True)
class PlanRequest:
    """What the user asks: a model on some GPUs, with a batch and a context length."""

    model: ModelSpec
    """The architecture."""
    gpu: GpuSpec
    """The GPU kind."""
    num_gpus: int
    """GPUs per node."""
    num_nodes: int = 1
    """Nodes."""
    seq_len: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step."""
    micro_batch: int = 1
    """Sequences per forward on one data-parallel rank."""
    precision: MixedPrecision = "bf16"
    """``bf16`` (``--bf16``), ``fp32`` or ``pure_bf16``; each layout runs it as ``precision_that_runs`` says."""
    attention: Attention = "sdpa"
    """Attention kernel."""
    activation_checkpointing: bool = True
    """Checkpoint every decoder layer."""
    lora: bool = False
    """Also consider LoRA on a frozen base, and prefer it."""
    lora_rank: int = 16
    """LoRA rank when ``lora``."""
    safety_margin: float = 0.10
    """Fraction of GPU memory left free."""
    train_tokens: float | None = None
    """Tokens to train on, for the wall-clock estimate."""
    assumptions: MemoryAssumptions = field(default_factory=MemoryAssumptions)
    """Framework allowances."""
    host_ram_bytes: int | None = None
    """Host RAM per node; None: the GPU kind's typical node (``GpuSpec.host_ram_per_gpu_bytes`` x GPUs)."""
    loading: Loading = "auto"
    """How the weights are loaded (``host.py``); ``auto``: as ``hf_dist.from_pretrained`` loads each layout."""
    base_efficiency: float | None = None
    """Measured compute efficiency (``calibrate.py``); None: the assumed ``ASSUMED_EFFICIENCY``."""
    efficiency_source: str | None = None
    """Where ``base_efficiency`` comes from, for the report."""
    intra_node_bandwidth: float | None = None
    """Bytes/s per GPU per direction inside a node; None: the GPU kind's (``GpuSpec.intra_node_bytes_per_s``)."""
    inter_node_bandwidth: float | None = None
    """Bytes/s per GPU per direction between nodes; None: the GPU kind's (``GpuSpec.inter_node_bytes_per_s``)."""
    useful_fraction: float = 1.0
    """Share of non-padding tokens (from the dataset's lengths), for useful tokens/s and MFU."""
    trainer: Literal["sft", "dpo", "grpo"] = "sft"
    """``sft`` (a plain or SFT step); ``dpo``: a micro batch of pairs runs chosen + rejected concatenated, beside a
    frozen reference; ``grpo``: the batch counts completions, generated in the step (a KV cache), with a reference
    when ``beta > 0``. DPO and GRPO are offered only the layouts their trainers run (``hf_dist.trl_support``)."""
    num_generations: int = GRPO_DEFAULTS["num_generations"]
    """GRPO: completions per prompt; the global batch must hold whole groups."""
    beta: float | None = None
    """GRPO's KL coefficient; a reference model is loaded only when it is > 0. None: TRL's default (0.0)."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "num_nodes", "seq_len", "global_batch", "micro_batch", "lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not 0 <= self.safety_margin < 1:
            raise ValueError(f"safety_margin={self.safety_margin} must be in [0, 1)")
        if self.precision not in MIXED_PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not known; use one of {', '.join(MIXED_PRECISIONS)}")
        if self.host_ram_bytes is not None and self.host_ram_bytes <= 0:
            raise ValueError(f"host_ram_bytes={self.host_ram_bytes} must be positive")
        self._check_trainer()
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive (bytes/s)")

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def memory_limit(self) -> int:
        return int(self.gpu.memory_bytes * (1 - self.safety_margin))

    def _check_trainer(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer={self.trainer!r} is not known; use one of {', '.join(TRAINERS)}")
        if self.trainer != "grpo":
            return
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations!r} must be an integer >= 2 (GRPO normalises "
                             f"rewards within a prompt's group)")
        groups, left = divmod(self.global_batch, self.num_generations)
        if left:
            nearest = sorted({max(groups, 1) * self.num_generations, (groups + 1) * self.num_generations})
            raise ValueError(f"global_batch={self.global_batch} counts GRPO completions (prompts x num_generations="
                             f"{self.num_generations}) and must hold whole prompt groups; use global_batch in "
                             f"{nearest}, or change num_generations")

    @property
    def has_reference(self) -> bool:
        """Whether the trainer runs a frozen reference model (DPO always; GRPO when ``beta > 0``)."""
        if self.trainer == "grpo":
            return (GRPO_DEFAULTS["beta"] if self.beta is None else self.beta) > 0
        return self.trainer == "dpo"

    @property
    def links(self) -> Links:
        """The link bandwidths the communication time uses."""
        return Links.of(self.gpu, intra_node=self.intra_node_bandwidth, inter_node=self.inter_node_bandwidth)

    @property
    def host_ram(self) -> int:
        """Host RAM per node."""
        return self.host_ram_bytes or self.gpu.host_ram_per_gpu_bytes * self.num_gpus


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """One layout, evaluated."""

    layout: Layout
    """The layout."""
    tier: int
    """Position in the decision table (lower communicates less)."""
    batch: BatchContract | None = None
    """Its batch contract (None when the batch rules it out)."""
    memory: MemoryBreakdown | None = None
    """Its peak memory (None when a rule rejected it first)."""
    throughput: Throughput | None = None
    """Its estimated step time and rates."""
    host: HostMemory | None = None
    """Its host RAM per node."""
    warnings: tuple[str, ...] = ()
    """What may still go wrong though it fits (loading over the host RAM)."""
    workload_precision: str = ""
    """The precision preset it was forecast in (``precision_that_runs``)."""
    fits: bool = False
    """Whether it fits with the safety margin."""
    chosen: bool = False
    """Whether the chooser picked it."""
    reason: str = ""
    """Why it was chosen or rejected."""

    @property
    def name(self) -> str:
        return self.layout.name


@dataclass(kw_only=True, frozen=True)
class Plan:
    """The ranked candidates and the choice."""

    request: PlanRequest
    """What was asked."""
    candidates: list[Candidate]
    """Every layout considered, in decision-table order."""

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.chosen), None)


def _tiers(req: PlanRequest) -> list[tuple[int, str, dict]]:
    """``(tier, strategy, make_layout kwargs)`` in decision-table order."""
    nodes, per_node = req.num_nodes, req.num_gpus
    # a MoE: experts inside a node (the token exchange on NVLink), the largest ep first (fewest expert replicas)
    eps = [ep for ep in (8, 4, 2) if ep <= per_node and per_node % ep == 0] if req.model.is_moe else []
    out = [(0, "ddp", {"ep": ep}) for ep in eps]
    out += [(0, "ddp", {}), (1, "zero1", {})]
    out += [(2, "fsdp_full_shard", {"ep": ep}) for ep in eps]
    out += [(2, "fsdp_shard_grad_op", {}), (2, "zero2", {})]
    if nodes > 1:
        out.append((3, "fsdp_hybrid_shard", {}))
    out += [(4, "fsdp_full_shard", {}), (4, "zero3", {})]
    tps = [tp for tp in (2, 4, 8) if tp <= per_node and per_node % tp == 0]
    # EP x TP: experts whole on each TP rank (no sequence parallelism), the ep ranks inside a node
    out += [(5, "fsdp_full_shard", {"tp": tp, "ep": ep}) for tp in tps for ep in eps if ep * tp <= per_node]
    out += [(5, "fsdp_full_shard", {"tp": tp, "sequence_parallel": True}) for tp in tps]
    pps = ([nodes] if nodes > 1 else []) + [p for p in (2, 4, 8) if p != nodes]
    for pp in pps:
        out += [(6, "fsdp_full_shard", {"pp": pp, "ep": ep}) for ep in eps]  # each stage's experts over its dp ranks
        out.append((6, "fsdp_full_shard", {"pp": pp}))
        if per_node > 1:  # pipeline stages apply TP without sequence parallelism
            out.append((6, "fsdp_full_shard", {"pp": pp, "tp": per_node}))
    out += [(7, "zero2", {"offload": "cpu"}), (7, "zero3", {"offload": "cpu_optimizer"}),
            (7, "fsdp_full_shard", {"offload": "cpu"}), (7, "zero3", {"offload": "cpu"}),
            (7, "zero3", {"offload": "nvme"})]
    cps, cp = [], 2
    while cp <= req.world_size:
        cps.append(cp)
        cp *= 2
    for cp in cps:
        out += [(8, "fsdp_full_shard", {"cp": cp, "ep": ep}) for ep in eps]
        out.append((8, "fsdp_full_shard", {"cp": cp}))
    return out


def _shape_rule(model: ModelSpec, layout: Layout) -> str | None:
    """Why the model cannot run ``layout`` at all: the run's own answer (``hf_dist.support.model_refusals``)."""
    from hf_dist.support import model_refusals

    reasons = model_refusals(spec_config(model), layout)
    return f"rule: {'; '.join(reasons)}" if reasons else None


def _evaluate(req: PlanRequest, tier: int, strategy: str, kwargs: dict, lora_rank: int) -> Candidate | None:
    tp, pp, cp = kwargs.get("tp", 1), kwargs.get("pp", 1), kwargs.get("cp", 1)
    if req.world_size % (tp * pp * cp):
        return None  # not a layout of this world size at all
    try:
        layout = make_layout(strategy, req.world_size, gpus_per_node=req.num_gpus, lora_rank=lora_rank, **kwargs)
    except ValueError:
        return None  # a layout hf_dist does not run (hf_dist.strategy.Layout's rules) is never offered
    rule = _shape_rule(req.model, layout)
    if not rule and req.trainer != "sft" and (why := trainer_layout_refusal(req.trainer, layout)):
        rule = f"rule: {why}"
    if rule:
        return Candidate(layout=layout, tier=tier, reason=rule)
    try:
        batch = BatchContract(world_size=req.world_size, global_batch_size=req.global_batch,
                              micro_batch_size=req.micro_batch, tp=tp, pp=pp, cp=cp, seq_len=req.seq_len)
    except ValueError as err:
        return Candidate(layout=layout, tier=tier, reason=f"rule: {err}")
    workload = _workload(req, layout, batch)
    memory = estimate_memory(req.model, workload, layout, req.assumptions)
    host = host_memory(req.model, workload, layout, memory, loading=req.loading, assumptions=req.assumptions)
    throughput = estimate_throughput(req.model, workload, layout, req.gpu, links=req.links,
                                     base_efficiency=req.base_efficiency, efficiency_source=req.efficiency_source,
                                     useful_fraction=req.useful_fraction)
    gpu_fits, host_fits = memory.fit_bytes <= req.memory_limit, host.offload <= req.host_ram
    reasons = [] if gpu_fits else [
        f"does not fit: needs {gib(memory.fit_bytes):.1f} GiB per GPU (in use {gib(memory.total):.1f} + largest "
        f"transient {gib(memory.largest_transient):.1f}), limit {gib(req.memory_limit):.1f} GiB ({req.gpu.name} "
        f"{gib(req.gpu.memory_bytes):.1f} GiB less {req.safety_margin:.0%} margin): over by "
        f"{gib(memory.fit_bytes - req.memory_limit):.1f} GiB"]
    if not host_fits:
        reasons.append(f"does not fit: offload needs {gib(host.offload):.0f} GiB of host RAM per node, the node "
                       f"has {gib(req.host_ram):.0f} GiB (--host-ram-gb)")
    warnings = () if host.loading <= req.host_ram else (_loading_warning(host, layout, req),)
    return Candidate(layout=layout, tier=tier, batch=batch, memory=memory, throughput=throughput, host=host,
                     fits=gpu_fits and host_fits, reason="; ".join(reasons), warnings=warnings,
                     workload_precision=workload.precision)


def _workload(req: PlanRequest, layout: Layout, batch: BatchContract) -> Workload:
    """What one rank runs per micro step under ``req.trainer``: DPO's micro batch of pairs is a forward of
    2 x micro sequences (chosen and rejected concatenated); TRL's fused LM head never holds the ``N x V`` logits
    (counted as the chunked loss) and keeps the head in FSDP's root; GRPO generates the rank's share of a global
    batch at once (one generation batch is one global batch, ``hf_dist.trainer.grpo``). ``sft`` plans DistTrainer's
    layout (DistSFTTrainer, whose fused LM head also keeps the head in the root, holds the head's weight and gradient
    through the step as well)."""
    trl = req.trainer != "sft"
    return Workload(seq_len=req.seq_len, micro_batch_size=req.micro_batch * (2 if req.trainer == "dpo" else 1),
                    precision=precision_that_runs(layout, req.precision), attention=req.attention,
                    activation_checkpointing=req.activation_checkpointing,
                    gradient_accumulation_steps=batch.gradient_accumulation_steps,
                    chunked_loss=trl or layout_refusal(layout) is None,  # as DistTrainer will compute the loss
                    reference_model=req.has_reference,
                    generation_sequences=req.micro_batch * batch.gradient_accumulation_steps
                    if req.trainer == "grpo" else 0, head_unit=not trl)


def _loading_warning(host: HostMemory, layout: Layout, req: PlanRequest) -> str:
    """The loading peak over the node's RAM, and the fix that applies to this layout."""
    if not layout.streaming_load:
        fix = "hf_dist.from_pretrained streams each rank's slices only for FSDP2/TP/PP layouts (ZeRO-3 loads "\
              "through zero.Init): use one of those, or load in bf16"
    elif req.loading == "every_rank":
        fix = "load with hf_dist.from_pretrained, which streams each rank's slices for this layout (--loading auto)"
    else:
        fix = "load in bf16, or use more ranks to split the model over"
    return (f"loading needs {gib(host.loading):.0f} GiB of host RAM per node ({host.how_loaded}), the node has "
            f"{gib(req.host_ram):.0f} GiB: {fix}")


CHOICE_MARGIN = 0.05
"""A layout later in the decision table is chosen only when its forecast step is more than this much faster: the
planner's throughput anchors (``bench/planner_anchors.py``) miss published runs by up to 5 %, so a smaller
difference does not say which layout is faster."""


def _pick(candidates: list[Candidate]) -> Candidate | None:
    """The first fitting candidate in decision-table order whose step time is within ``CHOICE_MARGIN`` of the
    fastest fitting one (LoRA layouts only, when one fits: ``--lora`` prefers them)."""
    fitting = [c for c in candidates if c.fits]
    if any(c.layout.lora_rank for c in fitting):
        fitting = [c for c in fitting if c.layout.lora_rank]
    if not fitting:
        return None
    fastest = min(c.throughput.step_time_s for c in fitting)
    return next(c for c in fitting if c.throughput.step_time_s <= fastest * (1 + CHOICE_MARGIN))


def _why_not(c: Candidate, chosen: Candidate, fastest: float) -> str:
    """Why a fitting candidate was not chosen (``fastest``: the fastest fitting step time ``_pick`` compared)."""
    if chosen.layout.lora_rank and not c.layout.lora_rank:
        return "--lora: a LoRA layout fits and is preferred to a full fine-tune"
    mine, theirs = c.throughput.step_time_s, chosen.throughput.step_time_s
    if mine > fastest * (1 + CHOICE_MARGIN):
        return f"slower than {chosen.name}: {mine:.3g} s/step vs {theirs:.3g}"
    order = (f"tier {chosen.tier} vs {c.tier}" if c.tier != chosen.tier
             else "same tier: EP before FSDP before ZeRO")
    return (f"{mine:.3g} s/step vs {chosen.name}'s {theirs:.3g}: within {CHOICE_MARGIN:.0%}, and {chosen.name} comes "
            f"first in the decision table ({order})")


def choose_layout(req: PlanRequest) -> Plan:
    """Evaluate every layout of the decision table and pick the fastest that fits (``_pick``)."""
    ranks = ([req.lora_rank] if req.lora else []) + [0]
    candidates = [c for rank in ranks for tier, strategy, kwargs in _tiers(req)
                  if (c := _evaluate(req, tier, strategy, kwargs, rank)) is not None]
    chosen = _pick(candidates)
    fastest = min((c.throughput.step_time_s for c in candidates if c.fits and bool(c.layout.lora_rank) ==
                   bool(chosen.layout.lora_rank)), default=0.0) if chosen else 0.0
    out = []
    for c in candidates:
        if c is chosen:
            t = c.throughput
            c = replace(c, chosen=True, reason=f"chosen: the fastest that fits ({t.step_time_s:.3g} s/step: compute "
                                               f"{t.compute_s:.3g}, communication {t.communication_s:.3g} of which "
                                               f"{t.communication.exposed_s:.3g} not overlapped; "
                                               f"{gib(c.memory.fit_bytes):.1f} GiB of {gib(req.memory_limit):.1f})")
        elif c.fits:
            c = replace(c, reason=f"fits ({gib(c.memory.fit_bytes):.1f} GiB) but {_why_not(c, chosen, fastest)}")
        out.append(c)
    return Plan(request=req, candidates=out)

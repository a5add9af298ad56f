"""Peak memory of one rank for a layout: every term named, in bytes, at the phase where the sum peaks.

``estimate_memory(model, workload, layout)`` returns a ``MemoryBreakdown``. Memory is added up at three
phases of a training step and the largest wins:

  * ``loss``: end of forward. Model states (gradients only where ``gradients_kept`` says they exist: not under DDP
    without accumulation), the root unit gathered (FSDP), every activation saved so far
    (checkpointed layer inputs, or all layers' saved tensors), the head's saved tensors and the loss peak:
    the larger of the logits alive in forward and the two extra fp32 ``N x V`` gradients of the loss backward.
  * ``backward``: the first layer to run backward. Model states (of the gradients, only the head's where the
    rest do not exist yet), every checkpointed input, the recomputed layer's full saved set, the
    activation-gradient working set, the gathered units in flight and the unsharded gradients (see ``states.py``).
  * ``backward_end`` (where ``gradients_kept`` is false): the last layer to run backward. Every gradient made,
    that layer's saved (or recomputed) set, the working set, the gathered units and unsharded gradients.
  * ``optimizer``: model states and the optimizer step's temporaries.
  * ``generation`` (GRPO only, ``Workload.generation_sequences``): model states, the units a forward gathers and the
    KV cache of the completions this rank generates at once (``kv_cache_bytes``).
A frozen reference model (``Workload.reference_model``: DPO, GRPO with ``beta > 0``) adds its parameters to every
phase, sharded like the policy's, without gradients or optimizer state (``reference_bytes``; nothing under LoRA, where
the reference is the policy with its adapters disabled). Its no-grad forward runs before the policy's and frees its
transients, so they are not counted.

With pipeline parallelism the first stage holds ``min(pp, accumulation)`` micro batches in flight (1F1B) and
the embedding; the last stage one micro batch, the head and the loss; the worse of the two is reported.

Three figures are reported. ``allocated``: the allocated peak (``torch.cuda.max_memory_allocated``).
``reserved``: what the caching allocator holds at that peak (``torch.cuda.max_memory_reserved``): allocated plus
``allocator_slack``, a calibrated fraction of the *transient* part of the peak (everything but the persistent
model states and buckets, which are allocated once and pack tightly; the transients -- gathered units,
activations, gradients of varying sizes -- leave cached blocks that later requests cannot reuse).
``total`` (``in use``, what ``nvidia-smi`` shows): reserved plus the CUDA context with cuBLAS workspace and
kernels (512 MiB) and NCCL buffers (512 MiB with more than one rank). The fit decision (``fit_bytes``) adds the
largest single transient allocation, which a fragmented cache may have to take as a fresh segment.

The slack fraction's basis (``CACHING_SLACK``): torchtitan's Llama-2-7B FSDP2 run on 8 x H100 (local batch 8,
seq 2048, full activation checkpointing, bf16 parameters with fp32 reduction; pytorch/torchtitan PR #165)
reported active 22.73 GiB and reserved 31.02 GiB; this model's allocated peak there was 23.40 GiB (+2.9 %) of
which 10.85 GiB transient, so slack = (31.02 - 23.40) / 10.85 = 0.70 of the transient (with the FSDP2 terms traced
on CPU since: 23.53 GiB, 10.98 transient, 0.68; the constant is kept). It is then checked against
the Harbor 13B figure (``bench/planner_anchors.py``). With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
freed pages coalesce; ``EXPANDABLE_SLACK`` (0.10) is an assumption, not calibrated against a published run. A layout
that gathers nothing (DDP, one process) reuses its cached blocks step after step: ``UNSHARDED_SLACK`` (0.10), from
one H200 run (0.06 measured, rounded up).
``MemoryAssumptions(device="cpu")`` drops slack and framework for the CPU benchmark.

Not here: which layout to pick (``chooser.py``), time (``throughput.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from hf_dist.planner.activations import ActivationModel, activation_model
from hf_dist.planner.catalogue import ModelSpec
from hf_dist.planner.workload import Layout, Workload
from hf_dist.planner.states import ModelStates, model_states
from hf_dist.precision import itemsize, tensor_dtypes

_MIB = 2**20


PERSISTENT_TERMS = ("parameters", "master_params", "gradients", "optimizer_states", "comm_buffers")
"""The terms allocated once or in the same sizes every step, which pack tightly: not in the slack's transient bytes
(gradients where a phase holds them)."""
CACHING_SLACK = 0.70
"""Reserved-but-unallocated memory as a fraction of the transient allocated bytes, for a sharded layout (FSDP,
ZeRO: gathered units and reduce buffers of many sizes; see the module docstring)."""
UNSHARDED_SLACK = 0.10
"""The same for a layout that gathers nothing (DDP, one process): each step allocates the same activations and
gradients again, and the cache serves them from the blocks the step before freed. Measured on one H200 (a 1B Llama,
4,096 tokens, bf16 autocast, ``docs/gpu_check.md``): 31.0 GiB reserved at 30.0 allocated, 0.06 of the 16.1 GiB
transient (0.02 with the chunked loss); rounded up."""
EXPANDABLE_SLACK = 0.10
"""The same with ``expandable_segments:True`` (assumed)."""
HOST_BUFFER_FACTOR = 1.5
"""Host RAM headroom over the bytes offloaded or loaded: DeepSpeed's ``additional_buffer_factor`` default in its
``estimate_zero2/3_model_states_mem_needs`` (pinned staging buffers and allocator slack)."""


@dataclass(kw_only=True, frozen=True)
class MemoryAssumptions:
    """The allowances that are not derived from the model."""

    device: Literal["cuda", "cpu"] = "cuda"
    """``cpu`` drops the CUDA context, NCCL and allocator allowances (the CPU benchmark)."""
    cuda_context_bytes: int = 512 * _MIB
    """CUDA context, cuBLAS workspace and loaded kernels, outside the caching allocator."""
    nccl_bytes: int = 512 * _MIB
    """NCCL communicator buffers when the job has more than one rank."""
    expandable_segments: bool = False
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: less reserved-but-unallocated memory."""
    host_buffer_factor: float = HOST_BUFFER_FACTOR
    """Host RAM headroom factor over offloaded and loaded bytes."""

    def slack(self, layout: Layout) -> float:
        """The allocator slack fraction for ``layout`` (``CACHING_SLACK``, ``UNSHARDED_SLACK``, ...)."""
        if self.device == "cpu":
            return 0.0
        if self.expandable_segments:
            return EXPANDABLE_SLACK
        return UNSHARDED_SLACK if layout.strategy == "ddp" else CACHING_SLACK


@dataclass(kw_only=True, frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the peak phase, by term; ``total`` is what the device shows in use."""

    parameters: int
    """Parameters as stored (sharded or replicated; frozen base for LoRA)."""
    master_params: int
    """Separate fp32 master copy (DeepSpeed)."""
    gradients: int
    """Gradients kept until the optimizer step."""
    optimizer_states: int
    """Adam moments (fp32) and step counters."""
    comm_buffers: int
    """DDP reducer buckets, DeepSpeed reduce buckets."""
    gathered_params: int
    """FSDP/ZeRO-3 gathered units in flight, the root unit."""
    unsharded_grads: int
    """Gradients of the unit in backward before reduce-scatter; the lm_head gradient."""
    activations: int
    """Saved for backward: checkpointed layer inputs, or every layer's saved tensors; head and loss."""
    recomputed_layer: int
    """The checkpointed layer recomputed in backward, with its full saved set."""
    activation_grads: int
    """Activation gradients alive while a layer runs backward."""
    logits: int
    """Logits and loss transients (logits, fp32 upcast, loss-backward gradients) beyond the saved log-softmax."""
    optimizer_step_temp: int
    """Temporaries of the optimizer step."""
    reference_model: int = 0
    """A frozen reference model's parameters (DPO, GRPO with beta > 0), sharded like the policy's; 0 under LoRA."""
    generation_cache: int = 0
    """GRPO's generation: the KV cache of the sequences this rank generates at once."""
    allocator_slack: int = 0
    """Reserved by the caching allocator above the allocated peak."""
    framework: int = 0
    """CUDA context and NCCL buffers, outside the allocator."""
    largest_transient: int = 0
    """The largest single transient allocation at the peak (headroom in the fit decision)."""
    peak_phase: str = ""
    """Which phase peaks: loss, backward or optimizer."""
    phase_totals: dict[str, int] = field(default_factory=dict)
    """Allocated bytes at each phase."""
    cpu_offload: int = 0
    """Bytes this rank keeps in CPU memory (offload)."""
    nvme_offload: int = 0
    """Bytes this rank keeps on NVMe (offload)."""
    stage: str = "all"
    """Pipeline stage reported: all (no PP), first or last."""

    TERMS = ("parameters", "master_params", "gradients", "optimizer_states", "comm_buffers", "gathered_params",
             "unsharded_grads", "activations", "recomputed_layer", "activation_grads", "logits",
             "optimizer_step_temp", "reference_model", "generation_cache")
    """The allocated terms."""

    @property
    def model_states(self) -> int:
        return self.parameters + self.master_params + self.gradients + self.optimizer_states

    @property
    def allocated(self) -> int:
        """The allocated peak (``torch.cuda.max_memory_allocated``)."""
        return sum(getattr(self, t) for t in self.TERMS)

    @property
    def reserved(self) -> int:
        """What the caching allocator holds at the peak (``torch.cuda.max_memory_reserved``)."""
        return self.allocated + self.allocator_slack

    @property
    def total(self) -> int:
        """In use on the device (``nvidia-smi``): reserved plus CUDA context and NCCL buffers."""
        return self.reserved + self.framework

    @property
    def fit_bytes(self) -> int:
        """What the fit decision compares with the limit: in use plus the largest transient allocation."""
        return self.total + self.largest_transient

    def terms(self) -> dict[str, int]:
        return {t: getattr(self, t) for t in self.TERMS}

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(model_states=self.model_states, allocated=self.allocated, reserved=self.reserved,
                   total=self.total, fit_bytes=self.fit_bytes)
        return out


def reference_bytes(model: ModelSpec, workload: Workload, layout: Layout, *, layers: int, first: bool,
                    last: bool) -> int:
    """The frozen reference's parameters on one rank: the policy's parameters of a full fine-tune on the same layout
    (stored and sharded alike, ``lay_out_reference``), nothing under LoRA (the adapter-disabled policy)."""
    if not workload.reference_model or layout.lora_rank:
        return 0
    return model_states(model, workload, layout, layers=layers, first=first, last=last).parameters


def kv_cache_bytes(model: ModelSpec, workload: Workload, layout: Layout, *, layers: int) -> int:
    """Keys and values of every layer for ``generation_sequences`` sequences of ``seq_len`` tokens, in the matmul
    dtype, the kv heads split over TP."""
    element = itemsize(tensor_dtypes(layout, workload.precision).matmuls)
    tokens = workload.generation_sequences * workload.seq_len
    return 2 * layers * model.kv_dim // layout.dims.tp * element * tokens


def gradients_kept(workload: Workload, layout: Layout) -> bool:
    """Whether the forecast counts every gradient while forward runs and through backward.

    Under DDP (and on one process) the gradients exist then only after an earlier micro-step of the same optimizer
    step (gradient accumulation, a pipeline's micro-batches): the Trainer's ``model.zero_grad()`` (``set_to_none``)
    frees them after each optimizer step, and backward makes them anew as it frees the activations (one H200, a 1B
    Llama at 4,096 tokens, no accumulation: 30.0 GiB measured, 29.95 forecast this way, 34.6 with them counted).
    DeepSpeed keeps them in flat buffers from step to step. Under FSDP they are counted, though FSDP2 frees its
    gradient shards at ``zero_grad()`` too (traced on 2 gloo ranks, ``tests/test_planner_peak_dist.py``): without
    them the two published FSDP2 runs the planner is checked against (``bench/planner_anchors.py``: torchtitan
    Llama-2-7B, NeMo Qwen3-30B-A3B) fall outside their targets (-10.3 % allocated, -19.8 % reserved); until a GPU
    trace names what FSDP2 holds there, the counted gradients stand for it (+3.5 % and -9.4 % with them).
    ``tests/test_planner.py`` checks the Trainer frees them as assumed."""
    return workload.gradient_accumulation_steps > 1 or layout.strategy != "ddp"


def _phases(states: ModelStates, acts: ActivationModel, workload: Workload, layout: Layout, *, layers: int,
            in_flight: int, first: bool, last: bool, reference: int = 0,
            kv_cache: int = 0) -> dict[str, dict[str, int]]:
    """Term values at each phase (allocated bytes, no allowances)."""
    ckpt = workload.activation_checkpointing
    common = dict(parameters=states.parameters, master_params=states.master_params, gradients=states.gradients,
                  optimizer_states=states.optimizer_states, comm_buffers=states.comm_buffers,
                  reference_model=reference)
    saved = in_flight * acts.saved_after_forward(layers=layers, checkpointing=ckpt, first_stage=first,
                                                 last_stage=False)
    head = acts.head + acts.loss if last else 0
    loss_peak = max(acts.logits_forward, acts.loss_backward) if last else 0
    # the chunked loss runs inside the root's forward, before FSDP2 frees its last all-gather's buffer
    inside_forward = workload.chunked_loss and not layout.vocab_parallel and last
    loss = dict(common, gradients=states.gradients if gradients_kept(workload, layout) else 0,
                gathered_params=states.gathered_at_loss + (states.last_gather_buffer if inside_forward else 0),
                activations=saved + head + acts.attention_mask,
                logits=loss_peak)
    in_backward = dict(common, gathered_params=states.gathered_in_backward, unsharded_grads=states.unsharded_grads,
                       activation_grads=acts.grad_working_set)
    backward = dict(in_backward, activations=saved + acts.attention_mask,
                    recomputed_layer=acts.layer.total if ckpt else 0)
    phases = {"loss": loss, "backward": backward}
    if not gradients_kept(workload, layout):  # gradients grow as backward frees the activations
        backward["gradients"] = states.head_gradients
        # the last layer to run backward: every gradient made, one layer's saved set left (recomputed if checkpointed)
        phases["backward_end"] = dict(in_backward, activations=(acts.checkpoint_input if ckpt else 0)
                                      + acts.attention_mask, recomputed_layer=acts.layer.total)
    phases["optimizer"] = dict(common, optimizer_step_temp=states.optimizer_step_temp)
    if kv_cache:  # generate runs the model's forward per token: units gathered as in a forward, the cache growing
        phases["generation"] = dict(common, gathered_params=states.gathered_in_backward, generation_cache=kv_cache)
    return phases


def _stage_breakdown(model: ModelSpec, workload: Workload, layout: Layout, assumptions: MemoryAssumptions, *,
                     layers: int, in_flight: int, first: bool, last: bool, stage: str) -> MemoryBreakdown:
    states = model_states(model, workload, layout, layers=layers, first=first, last=last)
    acts = activation_model(model, workload, layout)
    reference = reference_bytes(model, workload, layout, layers=layers, first=first, last=last)
    phases = _phases(states, acts, workload, layout, layers=layers, in_flight=in_flight, first=first, last=last,
                     reference=reference, kv_cache=kv_cache_bytes(model, workload, layout, layers=layers))
    totals = {name: sum(terms.values()) for name, terms in phases.items()}
    peak = max(totals, key=totals.get)
    terms = {t: 0 for t in MemoryBreakdown.TERMS} | phases[peak]
    persistent = sum(phases[peak][t] for t in PERSISTENT_TERMS)
    transient = totals[peak] - persistent - reference
    terms["allocator_slack"] = int(assumptions.slack(layout) * transient)
    if assumptions.device == "cuda":
        terms["framework"] = assumptions.cuda_context_bytes + (
            assumptions.nccl_bytes if layout.dims.world_size > 1 else 0)
    terms["largest_transient"] = max(states.largest_transient, acts.largest_tensor(last=last))
    return MemoryBreakdown(**terms, peak_phase=peak, phase_totals=totals, cpu_offload=states.cpu_bytes,
                           nvme_offload=states.nvme_bytes, stage=stage)


def estimate_memory(model: ModelSpec, workload: Workload, layout: Layout,
                    assumptions: MemoryAssumptions | None = None) -> MemoryBreakdown:
    """Peak memory of the worst rank of ``layout`` training ``model`` under ``workload``."""
    assumptions = assumptions or MemoryAssumptions()
    pp = layout.dims.pp
    if pp == 1:
        return _stage_breakdown(model, workload, layout, assumptions, layers=model.num_hidden_layers,
                                in_flight=1, first=True, last=True, stage="all")
    if pp > model.num_hidden_layers:
        raise ValueError(f"pp={pp} exceeds num_hidden_layers={model.num_hidden_layers}; use pp <= the layer count")
    layers = math.ceil(model.num_hidden_layers / pp)
    first = _stage_breakdown(model, workload, layout, assumptions, layers=layers,
                             in_flight=min(pp, workload.gradient_accumulation_steps), first=True, last=False,
                             stage="first")
    last = _stage_breakdown(model, workload, layout, assumptions, layers=model.num_hidden_layers - layers * (pp - 1),
                            in_flight=1, first=False, last=True, stage="last")
    return max(first, last, key=lambda b: b.total)


def gib(n: int | float) -> float:
    return n / 2**30


def format_breakdown(b: MemoryBreakdown) -> str:
    """One line per non-zero term, in GiB, then the totals."""
    lines = [f"  {name:<20} {gib(value):8.2f} GiB" for name, value in b.terms().items() if value]
    lines.append(f"  {'allocated peak':<20} {gib(b.allocated):8.2f} GiB  (phase: {b.peak_phase})")
    lines.append(f"  {'reserved':<20} {gib(b.reserved):8.2f} GiB  (allocator slack {gib(b.allocator_slack):.2f})")
    lines.append(f"  {'in use':<20} {gib(b.total):8.2f} GiB  ({b.total / 1e9:.1f} GB, with context + NCCL "
                 f"{gib(b.framework):.2f})")
    return "\n".join(lines)


__all__ = ["MemoryAssumptions", "MemoryBreakdown", "estimate_memory", "format_breakdown", "gib"]

"""What hf_dist knows about one causal-LM model type: one frozen record (``Family``) per type.

A record says which parallelisms are *proven* for the type (a parity test against one process passes for it: the
value names the test) and which are *refused by name* (the reason). Whatever is neither is refused by the run as
unproven. The support decisions of each parallelism (``hf_dist.*_parallel.support``), the planner and the coverage
table read these records; they hold no list of model types of their own.

Pure data: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Literal, Mapping

from hf_dist.families.tp_plans import ClassicPlan, HeadNorm

Kind = Literal["dense", "moe", "hybrid", "classic", "unknown"]
"""dense: attention + MLP decoder layers with transformers' plans; moe: routed experts; hybrid: linear-attention,
short-conv or state-space layers beside attention; classic: the older types transformers ships no plans for (hf_dist
writes them); unknown: a type hf_dist has no record for (nothing proven)."""

Parallelism = Literal["tp", "pp", "ep", "cp", "ep_pp", "ep_cp", "ep_tp"]
TpPlanSource = Literal["model", "hf_dist"]
"""model: transformers' ``base_model_tp_plan`` (and the head's ``_tp_plan``) with hf_dist's overlays; hf_dist:
hf_dist's own plan (the record's ``tp_classic`` or ``tp_base_plan``, from ``tp_plans.py``), used even when the
installed transformers ships a plan for the type."""
PARALLELISMS: tuple[Parallelism, ...] = ("tp", "pp", "ep", "cp", "ep_pp", "ep_cp", "ep_tp")
"""The cells a record may prove or refuse: each parallelism, and the products whose composition needs its own parity
test beyond both factors' (``ep_pp``: experts sharded over each pipeline stage's data-parallel ranks, the router
statistics passed between stages; ``ep_cp``: experts over the data-parallel ranks while each sequence is split over
the cp ranks, the router statistics pooled over them; ``ep_tp``: attention and dense MLPs split by TP while the experts
stay whole on each TP rank and are split by EP, the TP group's shared tokens sliced over its ranks before the
exchange)."""


ParityFields = Mapping[str, tuple[str | tuple[str, ...], ...]]
PARITY_FIELDS: ParityFields = MappingProxyType({
    "router": ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk"),
    "aux loss": (("router_aux_loss_coef", "output_router_logits"),),
    "window": ("sliding_window", "sliding_window_size"),
})
"""The config fields a parity case must set away from their defaults, by group: the routed experts per token, the
router aux loss (its coefficient and the flag that turns it on) and a sliding window. A group lists alternatives (the
names types give one quantity); an alternative is a field or fields that go together, and applies where the type's
config has its first field. A group is met when an alternative that applies has every field off its default; router
and aux-loss groups count only where the config has routed experts. A case on the defaults would pass while a layout
got these wrong. ``Family.parity_fields`` holds a type's groups."""


@dataclass(frozen=True, kw_only=True)
class PlannerShape:
    """How the planner's decoder (``hf_dist.planner.catalogue.ModelSpec``: q/k/v/o projections, a gated MLP or
    routed gated experts with a linear router, two norms per layer) describes this type's layers. A type without
    one is not modelled by the planner; ``tests/test_families.py`` checks every one against the built model."""

    qkv_bias: bool = False
    """q/k/v projections carry biases whatever ``attention_bias`` says (Qwen2)."""
    output_bias: bool = False
    """``o_proj`` carries a bias when ``attention_bias`` is set (Llama, gpt-oss), not only q/k/v."""
    qk_norm: bool = False
    """A per-head RMSNorm on queries and keys (``q_norm`` / ``k_norm``, ``head_dim`` wide)."""
    sinks: bool = False
    """One attention-sink logit per head (gpt-oss)."""
    router_bias: bool = False
    """The router has a bias (gpt-oss)."""
    expert_bias: bool = False
    """The routed experts' projections have biases (gpt-oss)."""


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model type's record."""

    model_type: str
    kind: Kind
    proven: Mapping[Parallelism, str] = field(default_factory=dict)
    """Parallelism -> the parity test (against one process) that proves it for this type."""
    refused: Mapping[Parallelism, str] = field(default_factory=dict)
    """Parallelism -> why it cannot run on this type (named refusals; checked before anything else)."""
    notes: Mapping[Parallelism, str] = field(default_factory=dict)
    """Parallelism -> how it runs on this type (shown in the coverage tables)."""
    tp_plan: TpPlanSource = "model"
    """Whose TP plan runs for this type (``TpPlanSource``). A type where both exist names the one its parity test
    proves; transformers adding a plan later (5.24: gptj, codegen, gpt_oss) changes nothing until this changes."""
    pp_layer_output: int | None = None
    """Override of what the model's code says about its decoder layers' output (``pipeline_parallel.layer_output``
    reads it from the base model's layer loop): 0, a tensor; n, a tuple of n. ``None``: read from the code."""
    pp_modules: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """hf_dist's pipeline plan where transformers ships none: (the base model's modules in forward order, the layer
    list among them; the head modules of the ``*ForCausalLM``). A ``base_model_pp_plan`` / ``_pp_plan`` of the
    installed transformers wins."""
    tp_classic: ClassicPlan | None = None
    """hf_dist's whole TP plan (relative to the ``*ForCausalLM``) with its config facts; used when ``tp_plan`` is
    ``"hf_dist"``."""
    tp_base_plan: Mapping[str, str] | None = None
    """hf_dist's ``base_model_tp_plan`` (relative to the base model); used when ``tp_plan`` is ``"hf_dist"``."""
    tp_overlay: Mapping[str, str] | None = None
    """TP entries laid over the model's plan (the whole plan where it has none) for non-attention layers: linear
    attention, short convolutions, Mamba2 mixers."""
    tp_overlay_sizes: Mapping[str, str | Callable] = field(default_factory=dict)
    """The sizes ``tp_overlay`` splits that the model's plan does not already name: ``{label: config field, or
    config -> int}`` (``fields.overlay_sizes`` reads them)."""
    tp_head_norm: HeadNorm | None = None
    """A norm over one head's features that the model's plan leaves out (its style, when its config flag is set)."""
    tp_replicated_kv: bool = False
    """k/v are separate Linears under ``model.layers.*.self_attn``: with fewer KV heads than TP ranks each rank may
    keep a copy of the KV head its query heads use."""
    tp_sequence_parallel: bool = False
    """The sequence- and vocab-parallel overlays (written for ``model.embed_tokens`` / ``input_layernorm`` /
    ``post_attention_layernorm`` / ``self_attn`` / ``mlp`` / ``model.norm``) fit this type's module names."""
    attention_head_params: tuple[str, ...] = ()
    """Parameters of the attention module holding one value per attention head that its attention function reads
    (gpt-oss's ``sinks``): under CP's all-to-all a rank attends over a subset of the heads and is handed their slice
    (``hf_dist.context_parallel.attention``)."""
    parity_fields: ParityFields = field(default_factory=lambda: PARITY_FIELDS)
    """The config fields the type's parity cases set away from their defaults (``PARITY_FIELDS``, or the type's own
    groups; ``tests/parity.py`` ``default_fields`` checks every case against them)."""
    planner: PlannerShape | None = None
    """How ``hf-dist plan`` describes the type's layers; ``None``: not modelled by the planner."""

    def __post_init__(self) -> None:
        for name in ("proven", "refused", "notes"):
            mapping = dict(getattr(self, name))
            unknown = sorted(set(mapping) - set(PARALLELISMS))
            if unknown:
                raise ValueError(f"{self.model_type}: {name} names {unknown}; parallelisms are {PARALLELISMS}")
            object.__setattr__(self, name, MappingProxyType(mapping))
        object.__setattr__(self, "parity_fields", MappingProxyType(dict(self.parity_fields)))
        both = sorted(set(self.proven) & set(self.refused))
        if both:
            raise ValueError(f"{self.model_type}: {both} both proven and refused")
        if (self.tp_classic is not None or self.tp_base_plan is not None) and self.tp_plan != "hf_dist":
            raise ValueError(f"{self.model_type}: carries hf_dist's TP plan but tp_plan={self.tp_plan!r}")

    def proves(self, parallelism: Parallelism) -> bool:
        """Whether a parity test proves ``parallelism`` on this type."""
        return parallelism in self.proven

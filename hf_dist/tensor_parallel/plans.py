"""Tensor-parallel plans from the model itself: its ``base_model_tp_plan`` and its head's ``_tp_plan``.

transformers ships, per architecture, a plan ``{module_pattern: style_name}`` (``"colwise"``, ``"rowwise"``,
``"colwise_gather_output"``, ...). ``model_plan`` reads it for a config, prefixed to be relative to the
``*ForCausalLM`` module; ``plan_names`` adds hf_dist's overlays on top; ``resolve_styles`` turns every name
into a torch DTensor ``ParallelStyle`` (composable with FSDP2). A pattern is a dotted module path where ``*``
stands for one path component (a layer index). hf_dist's overlays:

- fused projections: a ``qkv_proj`` / dense ``gate_up_proj`` that the model's plan gathers on every rank
  (Phi-3, GLM) is sharded part by part instead (``FusedColwiseParallel``), its partner row-parallel;
- routed MoE experts (``moe_tp_experts``): split along their intermediate dimension (``moe.py``), the router
  whole;
- the lm_head: column-parallel with its output gathered (the head's own plan) when the vocabulary divides by
  ``tp`` and the embeddings are not tied; whole otherwise (a tied weight is sharded only with the embedding,
  which is what vocab parallelism does);
- norms over one head's features that the model's plan leaves out: a weight shared by the heads (Phi
  ``qk_layernorm``) stays whole and its gradient, a partial sum per rank, is reduced over the TP ranks; a
  weight row per head (Cohere ``use_qk_norm``) is split by head;
- projections whose output the model modifies in place (OLMo ``clip_qkv``) hand it a copy;
- sequence parallelism, vocab parallelism (with ``VocabParallelCausalLMLoss``), and replicated KV heads when
  there are fewer KV heads than TP ranks, for the families whose module names they are written for.

- transformers' ``embedding_rowwise`` (5.24) on the input embedding: vocab-parallel under vocab parallelism,
  whole otherwise (``_embeddings``).

For the types whose registry record chooses hf_dist's plan (``Family.tp_plan``: the classic types GPT-2, Falcon,
OPT, BLOOM, GPT-J, ..., and gpt-oss), ``model_plan`` returns hf_dist's own plan, carried by the record
(``Family.tp_classic`` / ``tp_base_plan``, data in ``families/tp_plans.py``; styles from ``classic_styles.py``); the
overlays above apply to it the same way. Which model types may use these plans at all is decided in ``support.py``; sizes are checked
in ``checks.py``.
Not for: applying plans (``apply.py``).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from hf_dist.families import family_of, types_with
from hf_dist.tensor_parallel.classic import classic_plan
from hf_dist.tensor_parallel.classic_styles import (
    Conv1DColwise,
    Conv1DFusedSlice,
    Conv1DRowwise,
    LocalAlibi,
    LocalAttributes,
    RowwiseParallelWritableOutput,
)
from hf_dist.tensor_parallel.hybrid import HYBRID_STYLE_BUILDERS
from hf_dist.tensor_parallel.hybrid_styles import LocalParams
from hf_dist.tensor_parallel.styles import (
    ColwiseParallelWritableOutput,
    CombinedStyle,
    FusedColwiseParallel,
    HeadShardedNorm,
    LocalHeadCounts,
    ReplicatedKVColwise,
    ReplicatedWithGradReduce,
)
from hf_dist.tensor_parallel.moe import ExpertsTensorParallel
from hf_dist.tensor_parallel.support import (
    TP_TESTED_MODEL_TYPES,
    TP_TESTED_MOE_TYPES,
    check_tp_support,
    model_plan,
    moe_experts_patterns,
)

HEAD_PATTERNS: frozenset[str] = frozenset({"lm_head"})
"""Plan entries that may name nothing (a pipeline stage without the head); other entries must match."""

OVERLAY_FAMILIES: tuple[str, ...] = types_with("tp_sequence_parallel")
"""Families whose module names the sequence- and vocab-parallel overlays below are written for (their registry
records' ``tp_sequence_parallel``)."""

# Sequence parallelism: norms work on sequence shards; attention and MLP gather the sequence on entry and
# reduce-scatter it on exit. The gathered input stays a DTensor inside the module, so in backward the partial input
# gradients of its column-parallel projections (q, k, v; gate, up) add up locally and leave in one reduce-scatter,
# not one all-reduce per projection (the step ledger counted 5 all-reduces per block that way).
SEQUENCE_PARALLEL_OVERLAY = {
    "model.embed_tokens": "embedding_to_sequence_shards",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.self_attn": "gather_sequence_kwarg",
    "model.layers.*.mlp": "gather_sequence",
    "model.norm": "sequence_parallel",
}
_SP_OUTPUT_OVERRIDES = {"rowwise": "rowwise_to_sequence_shards"}

# Without sequence parallelism: the replicated input of attention and MLP enters them as a DTensor, for the same
# reason -- the partial input gradients of q, k, v (gate, up) add up locally and leave in one all-reduce per module
# (Megatron's count: 2 per block in backward), not one per projection (5 per block). Not with LoRA: its whole
# ``lora_A`` takes the same input as a plain tensor.
REPLICATED_INPUT_OVERLAY = {
    "model.layers.*.self_attn": "replicated_input_kwarg",
    "model.layers.*.mlp": "replicated_input",
}

# Fewer KV heads than TP ranks (MQA, narrow GQA): k/v projections replicated, one KV head kept per rank.
# A leading "+" adds the style to what the plan already has for that module (sequence gathering, say).
REPLICATED_KV_OVERLAY = {
    "model.layers.*.self_attn.k_proj": "replicated_kv",
    "model.layers.*.self_attn.v_proj": "replicated_kv",
    "model.layers.*.self_attn": "+local_head_counts",
}
REPLICATED_KV_FAMILIES: tuple[str, ...] = types_with("tp_replicated_kv")
"""Families with separate k/v projections (fused ones cannot keep one KV head per rank): their registry records'
``tp_replicated_kv``."""

# Projections whose output the model clamps in place when the config field is set (OLMo ``clip_qkv``).
IN_PLACE_OUTPUT_OVERLAY: dict[str, tuple[str, ...]] = {"clip_qkv": ("q_proj", "k_proj", "v_proj")}

# Fused projections the model's own plan gathers: shard each part, make the partner row-parallel.
_FUSED_OVERLAY = {
    "qkv_proj": ("fused_colwise_qkv", "o_proj", "local_head_counts"),
    "gate_up_proj": ("fused_colwise_gate_up", "down_proj", None),
}


def supported_families() -> tuple[str, ...]:
    """Model types with tensor parallelism from their own plan (proven by a parity test; ``support.py``)."""
    return tuple(sorted(TP_TESTED_MODEL_TYPES | TP_TESTED_MOE_TYPES))


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def _fuse(plan: dict[str, str]) -> dict[str, str]:
    """Gathered fused projections -> part-by-part sharded ones (``_FUSED_OVERLAY``)."""
    out = dict(plan)
    for pattern, style in plan.items():
        leaf = pattern.rpartition(".")[2]
        if leaf not in _FUSED_OVERLAY or style != "colwise_gather_output":
            continue
        fused, partner, on_parent = _FUSED_OVERLAY[leaf]
        partner_pattern = f"{_parent(pattern)}.{partner}"
        if out.get(partner_pattern) != "rowwise_split_input":
            continue
        out[pattern], out[partner_pattern] = fused, "rowwise"
        if on_parent:
            out[_parent(pattern)] = on_parent
    return out


def _experts(plan: dict[str, str]) -> dict[str, str]:
    """Routed experts (``moe_tp_experts`` with its parameter entries) -> one ``experts_tp`` entry on the module."""
    experts = moe_experts_patterns(plan)
    out = {p: s for p, s in plan.items() if p.rpartition(".")[0] not in experts}
    out.update(dict.fromkeys(experts, "experts_tp"))
    return out


def moe_dense_patterns(names: dict[str, str]) -> frozenset[str]:
    """Entries beside split experts that may match no module: a MoE model's dense-MLP entries (every layer sparse,
    or ``mlp_only_layers``/``first_k_dense_replace`` layers dense) live under the same ``mlp`` path."""
    parents = {_parent(p) for p, s in names.items() if s == "experts_tp"}
    return frozenset(p for p, s in names.items() if s != "experts_tp" and any(p.startswith(f"{q}.") for q in parents))


def whole_experts(names: dict[str, str]) -> dict[str, str]:
    """``names`` without the routed experts' entry: under expert parallelism each TP rank keeps its experts whole
    (the ``ep`` ranks split them; transformers' dispatch slices the TP group's shared tokens before the exchange)."""
    return {p: s for p, s in names.items() if s != "experts_tp"}


def _head(plan: dict[str, str], config, tp: int | None) -> dict[str, str]:
    """Keep the head's column split only where it is exact and cheap to undo (see module docstring)."""
    vocab = getattr(config, "vocab_size", None)
    tied = getattr(config, "tie_word_embeddings", False)
    keep = tp is not None and not tied and isinstance(vocab, int) and vocab % tp == 0
    return {p: s for p, s in plan.items() if p not in HEAD_PATTERNS or (keep and s == "colwise_gather_output")}


def lm_head_split(config, tp: int, *, vocab_parallel: bool = False) -> bool:
    """Whether TP over ``tp`` ranks splits the lm_head weight on the vocabulary: vocab parallelism, or the
    head's own column split where ``_head`` keeps it. The planner counts the head by this answer."""
    if tp <= 1:
        return False
    return vocab_parallel or "lm_head" in _head(model_plan(config), config, tp)


def _embeddings(plan: dict[str, str], vocab_parallel: bool) -> dict[str, str]:
    """transformers' ``embedding_rowwise`` (5.24): the vocab-parallel embedding under vocab parallelism, else the
    embedding kept whole (no entry), as before transformers named it: a sharded embedding beside a whole or tied
    head is what ``_head`` avoids, and the whole embedding is what the parity tests prove."""
    if vocab_parallel:
        return {p: "vocab_embedding" if s == "embedding_rowwise" else s for p, s in plan.items()}
    return {p: s for p, s in plan.items() if s != "embedding_rowwise"}


def base_plan(config, tp: int | None = None, *, vocab_parallel: bool = False) -> dict[str, str]:
    """The model's plan with the embedding, fused-projection and head overlays, as ``{pattern: style_name}``."""
    check_tp_support(config)
    plan = _head(_fuse(_experts(_embeddings(model_plan(config), vocab_parallel))), config, tp)
    for field, leaves in IN_PLACE_OUTPUT_OVERLAY.items():
        if getattr(config, field, None) is not None:
            plan.update({p: "colwise_writable_output" for p, s in plan.items()
                         if s == "colwise" and p.rpartition(".")[2] in leaves})
    norm = family_of(config).tp_head_norm  # a norm over one head's features the model's plan leaves out
    if norm is not None and getattr(config, norm.flag, False):
        plan.update(dict.fromkeys(norm.patterns, norm.style))
    return plan


def _kv_heads(config) -> int:
    classic = classic_plan(config)
    if classic is not None:
        return classic.kv_heads(config)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _replicates_kv(config, tp: int | None) -> bool:
    kv = _kv_heads(config)
    if tp is None or kv >= tp:
        return False
    if not family_of(config).tp_replicated_kv:
        raise ValueError(
            f"tp={tp} is larger than num_key_value_heads={kv}; replicating KV heads is available for "
            f"{', '.join(REPLICATED_KV_FAMILIES)}, not model_type={config.model_type!r}; use tp <= {kv}"
        )
    return True


def plan_names(
    config, *, sequence_parallel: bool = False, vocab_parallel: bool = False, tp: int | None = None,
    lora: bool = False,
) -> dict[str, str]:
    """The full plan as names: the model's plan, then the sequence- (or, without it and ``lora``, the
    replicated-input), vocab- and (``tp`` > KV heads) KV overlays. Two names on one module are joined with ``+`` and
    applied in that order."""
    plan = base_plan(config, tp, vocab_parallel=vocab_parallel)
    if (sequence_parallel or vocab_parallel) and not family_of(config).tp_sequence_parallel:
        raise ValueError(
            f"sequence_parallel/vocab_parallel are available for {', '.join(OVERLAY_FAMILIES)}, not for "
            f"model_type={config.model_type!r}; leave both False, or pass plan= with your own styles"
        )
    if sequence_parallel:
        plan = {pattern: _SP_OUTPUT_OVERRIDES.get(style, style) for pattern, style in plan.items()}
        for pattern, style in SEQUENCE_PARALLEL_OVERLAY.items():
            # the sequence gathered first, then what the plan already does on that module (Phi-3's local head
            # counts: replacing them left its attention computing every head on half the q/k/v columns)
            joins = style.startswith("gather_sequence") and pattern in plan
            plan[pattern] = f"{style}+{plan[pattern]}" if joins else style
        # the head's column split where ``_head`` kept it; a whole head (tied, or a vocabulary tp does not divide)
        # takes the gathered sequence. Splitting a tied head here once untied it from the whole embedding.
        plan["lm_head"] = "lm_head_from_sequence_shards" if "lm_head" in plan else "whole_lm_head_from_sequence_shards"
    elif family_of(config).tp_sequence_parallel and not lora:
        for pattern, style in REPLICATED_INPUT_OVERLAY.items():
            plan[pattern] = f"{style}+{plan[pattern]}" if pattern in plan else style
    if vocab_parallel:
        plan["model.embed_tokens"] = "vocab_embedding_to_sequence_shards" if sequence_parallel else "vocab_embedding"
        plan["lm_head"] = "vocab_lm_head_from_sequence_shards" if sequence_parallel else "vocab_lm_head"
    if _replicates_kv(config, tp):
        for pattern, name in REPLICATED_KV_OVERLAY.items():
            adds = name.startswith("+") and pattern in plan
            plan[pattern] = f"{plan[pattern]}{name}" if adds else name.lstrip("+")
    return plan


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _fused_qkv(config) -> ParallelStyle:
    head_dim = _head_dim(config)
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    return FusedColwiseParallel((config.num_attention_heads * head_dim, kv, kv))


def _replicated_kv(config) -> ParallelStyle:
    return ReplicatedKVColwise(kv_heads=config.num_key_value_heads, head_dim=_head_dim(config))


def _fused_gate_up(config) -> ParallelStyle:
    return FusedColwiseParallel((config.intermediate_size, config.intermediate_size))


def _local_attrs(config) -> ParallelStyle:
    classic = classic_plan(config)
    if classic is None:
        raise ValueError(
            f"style 'local_attrs' is for the classic plans (classic.py), not model_type={config.model_type!r}"
        )
    return LocalAttributes(classic.local_attrs)


_SEQ = Shard(1)
STYLE_BUILDERS = {
    # transformers' names (the model's own plans)
    "colwise": lambda config: ColwiseParallel(),
    "rowwise": lambda config: RowwiseParallel(),
    "colwise_gather_output": lambda config: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda config: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda config: ReplicatedWithGradReduce(input_dim=-2),
    # the vocab-parallel embedding; ``base_plan`` keeps the embedding whole instead without vocab parallelism
    "embedding_rowwise": lambda config: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    # hf_dist's overlays
    "colwise_writable_output": lambda config: ColwiseParallelWritableOutput(),
    "head_sharded_norm": lambda config: HeadShardedNorm(input_dim=-2),
    "local_head_counts": lambda config: LocalHeadCounts(),
    "fused_colwise_qkv": _fused_qkv,
    "fused_colwise_gate_up": _fused_gate_up,
    "experts_tp": lambda config: ExpertsTensorParallel(),
    "local_sinks": lambda config: LocalParams(shards={"sinks": ()}),
    "replicated_kv": _replicated_kv,
    "conv1d_colwise": lambda config: Conv1DColwise(),
    "conv1d_rowwise": lambda config: Conv1DRowwise(),
    "conv1d_fused_qkv_slice": lambda config: Conv1DFusedSlice((config.hidden_size,) * 3),
    "local_attrs": _local_attrs,
    "rowwise_writable_output": lambda config: RowwiseParallelWritableOutput(),
    "local_alibi": lambda config: LocalAlibi(config.num_attention_heads),
    "local_position_bias": lambda config: LocalAlibi(config.num_attention_heads, kwarg="position_bias"),
    "sequence_parallel": lambda config: SequenceParallel(),
    "rowwise_to_sequence_shards": lambda config: RowwiseParallel(output_layouts=_SEQ, use_local_output=False),
    "embedding_to_sequence_shards": lambda config: PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=_SEQ, use_local_output=False
    ),
    "replicated_input": lambda config: PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    ),
    "replicated_input_kwarg": lambda config: PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Replicate()},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=False,
    ),
    "gather_sequence": lambda config: PrepareModuleInput(
        input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),), use_local_output=False
    ),
    "gather_sequence_kwarg": lambda config: PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": _SEQ},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=False,
    ),
    "lm_head_from_sequence_shards": lambda config: ColwiseParallel(
        input_layouts=_SEQ, output_layouts=Replicate(), use_local_output=True
    ),
    "whole_lm_head_from_sequence_shards": lambda config: PrepareModuleInput(
        input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True
    ),
    "vocab_embedding": lambda config: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "vocab_embedding_to_sequence_shards": lambda config: RowwiseParallel(
        input_layouts=Replicate(), output_layouts=_SEQ, use_local_output=False
    ),
    "vocab_lm_head": lambda config: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
    "vocab_lm_head_from_sequence_shards": lambda config: ColwiseParallel(
        input_layouts=_SEQ, output_layouts=Shard(-1), use_local_output=True
    ),
}
"""Style name -> ``config -> ParallelStyle``: transformers' plan names first, then hf_dist's own."""
STYLE_BUILDERS.update(HYBRID_STYLE_BUILDERS)  # the hybrid overlays' styles (hybrid.py)


def resolve_styles(names: dict[str, str], config) -> dict[str, ParallelStyle]:
    """Turn ``{pattern: style_name}`` into ``{pattern: ParallelStyle}`` for this config."""
    plan: dict[str, ParallelStyle] = {}
    for pattern, joined in names.items():
        styles = []
        for name in joined.split("+"):
            if name not in STYLE_BUILDERS:
                raise ValueError(
                    f"plan entry {pattern!r} uses style {name!r}, which hf_dist does not know; known styles: "
                    f"{', '.join(sorted(STYLE_BUILDERS))}. Pass plan= with torch ParallelStyle objects instead"
                )
            styles.append(STYLE_BUILDERS[name](config))
        plan[pattern] = styles[0] if len(styles) == 1 else CombinedStyle(*styles)
    return plan

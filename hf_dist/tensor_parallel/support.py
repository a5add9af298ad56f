"""Which models hf_dist runs tensor-parallel: the one support decision for TP, from the config alone.

A model type is supported when it has a plan -- transformers' ``base_model_tp_plan``, or hf_dist's own
(its registry record's ``tp_classic`` / ``tp_base_plan``) where the record says so (``Family.tp_plan``: the plan its parity test
proves) -- its plan uses only styles hf_dist translates into DTensor styles (``plans.py``), its layers are attention
layers or ones its record's overlay (``Family.tp_overlay``) shards (linear attention, short convolutions, Mamba2), its config has none of
the values the classic plan names as inexact, and its registry record (``hf_dist.families``) proves TP: a TP=2
parity test against one process passes for it (``tests/test_tp_sweep.py``; MoE types: ``tests/test_moe_tp.py``).
MoE types are supported when their plan names the routed experts ``moe_tp_experts`` (split along the intermediate
dimension by ``moe.py``) and their parity test passes; other MoE layouts (zero experts, no such entry) are refused.
Everything else is refused by name with the reason: MoE experts without a case, latent attention, attention sinks,
linear-attention or state-space layers no overlay shards, no plan, no parity test yet.

Pure: a config in, a reason or ``None`` out; ``check_tp_support`` raises the ``ValueError`` before any process
group starts. Not for: sizes (``checks.py``) or building plans (``plans.py``).
"""

from __future__ import annotations

from hf_dist.families import expert_count_field, family, proven_types
from hf_dist.tensor_parallel.classic import CLASSIC_STYLES, classic_plan
from hf_dist.tensor_parallel.moe import MOE_STYLES, own_plan
from hf_dist.tensor_parallel.hybrid import HYBRID_STYLES, hybrid_overlay, hybrid_tp_refusal

TP_TESTED_MODEL_TYPES: frozenset[str] = proven_types("tp", kinds=("dense", "classic", "hybrid"))
"""Model types whose registry records prove TP: their TP=2 run equals one process (loss, gradients, parameters) in
``tests/test_tp_sweep.py`` (hybrids: their linear-attention / short-conv / Mamba2 layers sharded by ``hybrid.py``)."""
TP_TESTED_MOE_TYPES: frozenset[str] = proven_types("tp", kinds=("moe",))
"""MoE types whose TP=2 run (routed experts split by ``moe.py``, router aux loss on) equals one process over 3
AdamW steps with clipping active (``tests/test_moe_tp.py``)."""

_MOE = "MoE experts (TP does not shard them; expert parallelism: --ep_size)"
_STYLE_REASONS = {
    "moe_tp_experts": _MOE,
    "packed_colwise": _MOE,
    "packed_rowwise": _MOE,
    "moe_identity_expert": "zero (identity) experts, which TP would sum once per rank",
    "mla_kv_a_proj": "multi-head latent attention (the shared rotary key needs its own gradient reduction)",
    "local_params": "attention sinks (a per-head parameter outside any Linear)",
}
TRANSLATED_STYLES: frozenset[str] = frozenset({
    "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
    "embedding_rowwise",
})
"""transformers' style names that ``plans.STYLE_BUILDERS`` turns into DTensor styles (``embedding_rowwise``: the
vocab-parallel embedding under vocab parallelism, the embedding kept whole otherwise; ``plans.base_plan``)."""
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def causal_lm_class(config) -> type:
    """The ``*ForCausalLM`` class transformers builds for ``config`` (``ValueError`` when there is none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(
            f"{type(config).__name__} (model_type={getattr(config, 'model_type', None)!r}) has no causal-LM "
            f"class in transformers; tensor parallelism in hf_dist is for *ForCausalLM models"
        ) from None


def model_plan(config) -> dict[str, str]:
    """The plan relative to the ``*ForCausalLM`` that its registry record chooses (``Family.tp_plan``):

    - ``"model"``: transformers' ``base_model_tp_plan`` under the base model's attribute name, plus the head's
      ``_tp_plan`` and the hybrid overlay (the overlay alone where transformers ships no plan);
    - ``"hf_dist"``: hf_dist's own plan (the record's ``tp_classic``, or ``tp_base_plan`` in the same form as
      transformers'), even when the installed transformers ships one.

    Empty when there is none."""
    if family(getattr(config, "model_type", None)).tp_plan == "hf_dist":
        if (classic := classic_plan(config)) is not None:
            return classic.plan_for(config)
        base = own_plan(config)
    else:
        base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return hybrid_overlay(config)
    cls = causal_lm_class(config)
    plan = {f"{cls.base_model_prefix}.{pattern}": style for pattern, style in base.items()}
    plan.update(getattr(cls, "_tp_plan", None) or {})
    plan.update(hybrid_overlay(config))
    return plan


def moe_experts_patterns(plan: dict[str, str]) -> set[str]:
    """The experts modules of ``plan`` TP splits by ``moe.ExpertsTensorParallel``: a ``moe_tp_experts`` entry whose
    parameter entries are exactly ``gate_up_proj: packed_colwise`` and ``down_proj: rowwise``."""
    out = set()
    for pattern, style in plan.items():
        if style != "moe_tp_experts":
            continue
        params = {p[len(pattern) + 1:]: s for p, s in plan.items() if p.startswith(f"{pattern}.")}
        if params == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}:
            out.add(pattern)
    return out


def _moe_entries(plan: dict[str, str]) -> set[str]:
    experts = moe_experts_patterns(plan)
    return {p for p in plan if p in experts or p.rpartition(".")[0] in experts}


def _layer_kinds(config) -> set[str]:
    names = ("layer_types", "layers_block_type", "block_types")
    kinds = [kind for name in names for kind in getattr(config, name, None) or ()]
    return {kind for kind in kinds if isinstance(kind, str)} - _ATTENTION_LAYERS - {"attention"}


_STATE_SPACE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "d_state", "attention_hidden_size")


def _family_refusal(config, plan: dict[str, str]) -> str | None:
    """MoE (unless the plan's experts are split by ``moe.py``), the registry's named refusals, and state-space /
    hybrid models, named as such whether or not they ship a plan."""
    moe = expert_count_field(config)
    if moe and not moe_experts_patterns(plan):
        return f"{_MOE}: {moe}"
    named = family(getattr(config, "model_type", None)).refused
    if "tp" in named:  # named in the registry
        return named["tp"]
    if hybrid := hybrid_tp_refusal(config):
        return hybrid
    if hybrid_overlay(config):
        return None  # its non-attention layers are sharded by the overlay
    if kinds := _layer_kinds(config):
        return f"linear-attention, recurrent or state-space layers ({', '.join(sorted(kinds))}) that TP does not shard"
    ssm = [name for name in _STATE_SPACE_FIELDS if getattr(config, name, None) is not None]
    if ssm:
        return f"state-space / recurrent layers ({ssm[0]}) that no plan shards"
    return None


def tp_refusal(config) -> str | None:
    """Why ``config``'s model cannot run tensor-parallel in hf_dist, or ``None`` when it can."""
    model_type = getattr(config, "model_type", None)
    record = family(model_type)
    try:
        plan = model_plan(config)
    except ValueError as err:
        return str(err)
    moe = _moe_entries(plan)
    reasons = sorted({_STYLE_REASONS[s] for p, s in plan.items() if s in _STYLE_REASONS and p not in moe})
    if reasons:
        return "; ".join(reasons)
    if kind_reason := _family_refusal(config, plan):
        return kind_reason
    classic = classic_plan(config)
    if classic is not None and (reason := classic.refusal(config)):
        return reason
    if not plan:
        return f"transformers ships no base_model_tp_plan for model_type={model_type!r}"
    own = CLASSIC_STYLES if classic_plan(config) is not None else HYBRID_STYLES
    known = TRANSLATED_STYLES | own | MOE_STYLES
    unknown = sorted({name for p, s in plan.items() if p not in moe for name in s.split("+") if name not in known})
    if unknown:
        return f"its plan uses styles hf_dist does not translate: {', '.join(unknown)}"
    if moe and not (record.proves("tp") and record.kind == "moe"):
        return (f"MoE experts: no TP parity test in hf_dist for model_type={model_type!r} yet (routed experts under "
                f"TP are proven for {', '.join(sorted(TP_TESTED_MOE_TYPES))}; expert parallelism: --ep_size)")
    if not record.proves("tp"):
        return f"no TP parity test in hf_dist for model_type={model_type!r} yet"
    return None


def check_tp_support(config) -> None:
    """Raise ``ValueError`` naming the model type and the reason when TP is not available for ``config``."""
    reason = tp_refusal(config)
    if reason is None:
        return
    raise ValueError(
        f"tensor parallelism is not available for model_type={getattr(config, 'model_type', None)!r}: {reason}. "
        f"Use tp_size=1 (FSDP2 or DDP shard this model), or pass apply_tensor_parallel(model, tp_mesh, "
        f"plan={{pattern: ParallelStyle}}) with your own torch styles ('*' matches one path component)"
    )


def model_type_tp_refusal(model_type: str) -> str | None:
    """``tp_refusal`` for the default config of ``model_type`` (what is known of a model before its config)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:  # noqa: BLE001 - a config class that cannot be built has no TP either
        return f"model_type={model_type!r} has no default config in installed transformers ({type(error).__name__})"
    return tp_refusal(config)


def tp_coverage() -> dict[str, str]:
    """``{model_type: "yes" or the refusal reason}`` for every causal-LM model type of installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {t: model_type_tp_refusal(t) or "yes" for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)}

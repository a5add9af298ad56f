"""Tensor-parallel plans as data: ``{module_fqn_pattern: style_name}`` per architecture family.

A pattern is a dotted module path relative to the ``*ForCausalLM`` model, where ``*`` stands for one path
component (a layer index). A style name is resolved against the model config into a torch ``ParallelStyle``
by ``resolve_styles``, because a few styles need sizes (fused part widths) that only the config knows.

Where transformers ships a ``base_model_tp_plan`` that shards without gathering (Llama, Mistral, Qwen2,
Qwen3) it is used, prefixed with ``model.``; Phi-3's own plan gathers the fused projections' output on every
rank, so hf_dist uses its own plan that shards each fused part instead. Sequence parallelism and
vocab parallelism are overlays applied on top of the base plan.

Not for: applying plans (``apply.py``) or size checks (``checks.py``).
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

from hf_dist.tensor_parallel.styles import (
    CombinedStyle,
    FusedColwiseParallel,
    LocalHeadCounts,
    ReplicatedKVColwise,
    ReplicatedWithGradReduce,
)

# hf_dist's own plans, for families whose transformers plan is missing or gathers activations.
_PHI3_PLAN = {
    "model.layers.*.self_attn": "local_head_counts",
    "model.layers.*.self_attn.qkv_proj": "fused_colwise_qkv",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_up_proj": "fused_colwise_gate_up",
    "model.layers.*.mlp.down_proj": "rowwise",
}

HF_DIST_PLANS: dict[str, dict[str, str]] = {"phi3": _PHI3_PLAN}
"""Plans hf_dist owns, by ``config.model_type``; they take precedence over transformers' ones."""

HF_PLAN_FAMILIES: dict[str, str] = {
    "llama": "model", "mistral": "model", "qwen2": "model", "qwen3": "model", "gpt_neox": "gpt_neox",
}
"""Families whose transformers ``base_model_tp_plan`` is used as is (translated to torch styles), with the
prefix of the base model inside the ``*ForCausalLM``. GPT-NeoX's fused ``query_key_value`` is laid out head by
head ([q k v] per head), so a plain column split keeps whole heads together."""

OVERLAY_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "phi3")
"""Families whose module names the sequence- and vocab-parallel overlays below are written for."""

# Sequence parallelism: norms work on sequence shards; attention and MLP gather the sequence on entry and
# reduce-scatter it on exit. Applies to every family above (they share these module names).
SEQUENCE_PARALLEL_OVERLAY = {
    "model.embed_tokens": "embedding_to_sequence_shards",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.self_attn": "gather_sequence_kwarg",
    "model.layers.*.mlp": "gather_sequence",
    "model.norm": "sequence_parallel",
}
_SP_OUTPUT_OVERRIDES = {"rowwise": "rowwise_to_sequence_shards"}

# Fewer KV heads than TP ranks (MQA, narrow GQA): k/v projections replicated, one KV head kept per rank.
# A leading "+" adds the style to what the plan already has for that module (sequence gathering, say).
REPLICATED_KV_OVERLAY = {
    "model.layers.*.self_attn.k_proj": "replicated_kv",
    "model.layers.*.self_attn.v_proj": "replicated_kv",
    "model.layers.*.self_attn": "+local_head_counts",
}
REPLICATED_KV_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""Families with separate k/v projections (fused ones cannot keep one KV head per rank)."""


def supported_families() -> tuple[str, ...]:
    return tuple(sorted((*HF_PLAN_FAMILIES, *HF_DIST_PLANS)))


def _unknown_family_error(model_type: str) -> ValueError:
    return ValueError(
        f"no tensor-parallel plan for model_type={model_type!r}; hf_dist has plans for "
        f"{', '.join(supported_families())}. For another architecture pass your own plan: "
        f"apply_tensor_parallel(model, tp_mesh, plan={{'model.layers.*.self_attn.q_proj': ColwiseParallel(), ...}}) "
        f"with torch ParallelStyle objects keyed by module path ('*' matches one path component)"
    )


def base_plan(config) -> dict[str, str]:
    """The family's plan as ``{pattern: style_name}`` (without overlays)."""
    model_type = getattr(config, "model_type", None)
    if model_type in HF_DIST_PLANS:
        return dict(HF_DIST_PLANS[model_type])
    if model_type in HF_PLAN_FAMILIES:
        hf_plan = getattr(config, "base_model_tp_plan", None) or {}
        if not hf_plan:
            raise ValueError(f"transformers ships no base_model_tp_plan for model_type={model_type!r}")
        prefix = HF_PLAN_FAMILIES[model_type]
        return {f"{prefix}.{pattern}": style for pattern, style in hf_plan.items()}
    raise _unknown_family_error(model_type)


def _replicates_kv(config, tp: int | None) -> bool:
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if tp is None or kv >= tp:
        return False
    if config.model_type not in REPLICATED_KV_FAMILIES:
        raise ValueError(
            f"tp={tp} is larger than num_key_value_heads={kv}; replicating KV heads is available for "
            f"{', '.join(REPLICATED_KV_FAMILIES)}, not model_type={config.model_type!r}; use tp <= {kv}"
        )
    return True


def plan_names(
    config, *, sequence_parallel: bool = False, vocab_parallel: bool = False, tp: int | None = None
) -> dict[str, str]:
    """The full plan as names: base plan, then the sequence-, vocab- and (``tp`` > KV heads) KV overlays.

    Two names on one module are joined with ``+`` and applied in that order.
    """
    plan = base_plan(config)
    if (sequence_parallel or vocab_parallel) and config.model_type not in OVERLAY_FAMILIES:
        raise ValueError(
            f"sequence_parallel/vocab_parallel are available for {', '.join(OVERLAY_FAMILIES)}, not for "
            f"model_type={config.model_type!r}; leave both False, or pass plan= with your own styles"
        )
    if sequence_parallel:
        plan = {pattern: _SP_OUTPUT_OVERRIDES.get(style, style) for pattern, style in plan.items()}
        plan.update(SEQUENCE_PARALLEL_OVERLAY)
        plan["lm_head"] = "lm_head_from_sequence_shards"
    if vocab_parallel:
        plan["model.embed_tokens"] = "vocab_embedding_to_sequence_shards" if sequence_parallel else "vocab_embedding"
        plan["lm_head"] = "vocab_lm_head_from_sequence_shards" if sequence_parallel else "vocab_lm_head"
    if _replicates_kv(config, tp):
        for pattern, name in REPLICATED_KV_OVERLAY.items():
            adds = name.startswith("+") and pattern in plan
            plan[pattern] = f"{plan[pattern]}{name}" if adds else name.lstrip("+")
    return plan


def _fused_qkv(config) -> ParallelStyle:
    head_dim = _head_dim(config)
    kv = config.num_key_value_heads * head_dim
    return FusedColwiseParallel((config.num_attention_heads * head_dim, kv, kv))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _replicated_kv(config) -> ParallelStyle:
    return ReplicatedKVColwise(kv_heads=config.num_key_value_heads, head_dim=_head_dim(config))


def _fused_gate_up(config) -> ParallelStyle:
    return FusedColwiseParallel((config.intermediate_size, config.intermediate_size))


_SEQ = Shard(1)
STYLE_BUILDERS = {
    "colwise": lambda config: ColwiseParallel(),
    "rowwise": lambda config: RowwiseParallel(),
    "replicated_with_grad_allreduce": lambda config: ReplicatedWithGradReduce(input_dim=-2),
    "local_head_counts": lambda config: LocalHeadCounts(),
    "fused_colwise_qkv": _fused_qkv,
    "fused_colwise_gate_up": _fused_gate_up,
    "replicated_kv": _replicated_kv,
    "sequence_parallel": lambda config: SequenceParallel(),
    "rowwise_to_sequence_shards": lambda config: RowwiseParallel(output_layouts=_SEQ, use_local_output=False),
    "embedding_to_sequence_shards": lambda config: PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=_SEQ, use_local_output=False
    ),
    "gather_sequence": lambda config: PrepareModuleInput(
        input_layouts=(_SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True
    ),
    "gather_sequence_kwarg": lambda config: PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": _SEQ},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=True,
    ),
    "lm_head_from_sequence_shards": lambda config: ColwiseParallel(
        input_layouts=_SEQ, output_layouts=Replicate(), use_local_output=True
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
"""Style name -> ``config -> ParallelStyle``. Names from transformers plans map to the same torch styles."""


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

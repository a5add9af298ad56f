"""Which models run with context parallelism, and why the others are refused -- before any process group starts.

Used by ``DistTrainer`` (``check_cp_support``), ``hf_dist.support.model_refusals`` (the planner) and
``docs/coverage.md`` (``cp_support_table``):

- the model type's registry record proves CP (``hf_dist.families``; ``CP_MODEL_TYPES`` is that view: its decoder layers take
  ``position_embeddings`` from the model, its attention goes through transformers' attention registry, and any
  per-head parameter its attention function reads -- gpt-oss's sinks -- is named in the record
  (``attention_head_params``), so a rank attending over a subset of the heads reads their values);
- ``num_attention_heads`` and ``num_key_value_heads`` divide by ``tp_size x cp_size`` (TP leaves each rank
  ``heads / tp``, the all-to-all hands each rank ``heads / (tp x cp)``). Ring attention (torch's ``context_parallel``), which needs no divisibility, is not run by hf_dist:
  on CPU/gloo it cannot run at all (it intercepts SDPA's flash / memory-efficient / cuDNN kernels only).
"""

from __future__ import annotations

from hf_dist.families import FAMILIES, attention_heads, family

CP_MODEL_TYPES: dict[str, str] = {
    t: f"{f.notes.get('cp', 'all-to-all')}; tested: {f.proven['cp']}" for t, f in FAMILIES.items() if f.proves("cp")
}
"""Model type -> how CP runs on it, for the types the registry proves CP for."""


def cp_refusal(config, cp_size: int, tp_size: int = 1) -> str | None:
    """Why ``config``'s model cannot run with ``cp_size`` (and ``tp_size``) (None: it can). Pure."""
    if cp_size == 1:
        return None
    model_type = getattr(config, "model_type", None)
    if not family(model_type).proves("cp"):
        return (f"model_type={model_type!r} has no context-parallel parity test in hf_dist; context parallelism runs "
                f"{', '.join(CP_MODEL_TYPES)} (docs/coverage.md); drop cp_size")
    heads, kv_heads = attention_heads(config)
    split = cp_size * tp_size
    if heads % split or kv_heads % split:
        valid = [d for d in range(1, kv_heads // tp_size + 1) if (kv_heads % (d * tp_size) == 0
                                                                 and heads % (d * tp_size) == 0)]
        by_tp = f" x tp_size={tp_size}" if tp_size > 1 else ""
        return (f"cp_size={cp_size}{by_tp} does not divide num_attention_heads={heads} and num_key_value_heads="
                f"{kv_heads}: the all-to-all gives each rank heads / (tp x cp) heads. Ring attention (torch "
                f"context_parallel), which would not need it, is not run by hf_dist (on CPU it cannot run at all); "
                f"use cp_size in {valid}")
    return None


def check_cp_support(config, cp_size: int, tp_size: int = 1) -> None:
    """``ValueError`` naming the model, the rule and the fix when ``cp_refusal`` refuses."""
    why = cp_refusal(config, cp_size, tp_size)
    if why is not None:
        raise ValueError(why)


def cp_support_table() -> str:
    """The coverage table docs/coverage.md shows (the same ``CP_MODEL_TYPES`` the trainer checks)."""
    rows = ["| model type | context parallelism |", "|---|---|"]
    rows += [f"| {name} | {how} |" for name, how in CP_MODEL_TYPES.items()]
    return "\n".join(rows)

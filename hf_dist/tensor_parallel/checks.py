"""Size checks for tensor parallelism, run before any process group or parameter is touched: the one TP-shape
rule (training, the planner and the CLI all ask ``valid_tp_sizes`` / ``check_tp_sizes``).

Pure functions on a model config and a TP degree. The sizes checked are the ones the model's plan actually
shards: attention heads when it splits attention projections, the MLP width when it splits the MLP, a routed
expert's width when it splits the experts, the vocabulary under vocab parallelism. A model without TP support (``support.py``) has only ``tp=1``. Errors
say which value fails, the rule, and which TP degrees would work. Not for: building plans.
"""

from __future__ import annotations

from math import gcd

from hf_dist.families import family_of
from hf_dist.tensor_parallel.classic import classic_plan
from hf_dist.tensor_parallel.hybrid import hybrid_sizes
from hf_dist.tensor_parallel.support import check_tp_support, model_plan, moe_experts_patterns, tp_refusal

_SHARDING_STYLES = frozenset({"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input"})
_ATTENTION_PARENTS = frozenset({"self_attn", "attention", "attn", "self_attention"})
_MLP_PARENTS = frozenset({"mlp", "feed_forward", "ffn"})
_MLP_WIDTH_FIELDS = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")
_EXPERT_WIDTH_FIELDS = ("moe_intermediate_size", "intermediate_size")
"""A routed expert's intermediate width, split by ``moe.ExpertsTensorParallel`` (first field the config has)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sharded_parents(config) -> set[str]:
    """The parent module names (``self_attn``, ``mlp``, ...) of the Linears the model's plan splits."""
    return {
        pattern.split(".")[-2]
        for pattern, style in model_plan(config).items()
        if style in _SHARDING_STYLES and pattern.count(".") >= 1 and not pattern.startswith("lm_head")
    }


def _mlp_width(config) -> tuple[str, int | list[int]]:
    for field in _MLP_WIDTH_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) or (isinstance(value, (list, tuple)) and value):
            return field, value
    raise ValueError(
        f"model_type={config.model_type!r}: its tensor-parallel plan splits the MLP but the config has none of "
        f"{', '.join(_MLP_WIDTH_FIELDS)}; pass plan= with your own styles"
    )


def sharded_sizes(config, *, vocab_parallel: bool) -> dict[str, int | list[int]]:
    """The config values that TP splits evenly: ``{name: value}`` (heads, MLP width, vocab), read from what
    the model's plan shards. A per-layer list means every entry is split."""
    classic = classic_plan(config)
    if classic is not None:  # its plan splits heads and the MLP; the MLP width is read as its data says
        sizes = {"num_attention_heads": config.num_attention_heads, "mlp_width": classic.mlp_width(config)}
        return {**sizes, "vocab_size": config.vocab_size} if vocab_parallel else sizes
    parents = _sharded_parents(config)
    sizes: dict[str, int | list[int]] = {}
    if parents & _ATTENTION_PARENTS:
        sizes["num_attention_heads"] = config.num_attention_heads
    if parents & _MLP_PARENTS:
        field, value = _mlp_width(config)
        sizes[field] = list(value) if isinstance(value, (list, tuple)) else value
    if moe_experts_patterns(model_plan(config)):  # routed experts split along their intermediate dimension
        field = next(f for f in _EXPERT_WIDTH_FIELDS if isinstance(getattr(config, f, None), int))
        sizes[field] = getattr(config, field)
    sizes.update(hybrid_sizes(config))  # linear-attention heads, short-conv channels (hybrid.py)
    if vocab_parallel:
        sizes["vocab_size"] = config.vocab_size
    return sizes


def _kv_heads(config) -> int | None:
    """KV heads when the plan splits attention (``None`` otherwise)."""
    if (classic := classic_plan(config)) is not None:
        return classic.kv_heads(config)
    if not _sharded_parents(config) & _ATTENTION_PARENTS:
        return None
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _kv_fits(config, kv_heads: int | None, tp: int) -> bool:
    """KV heads split evenly (kv % tp == 0) or, fewer than the ranks and for a family whose k/v projections
    are separate Linears, replicated (tp % kv == 0)."""
    if kv_heads is None or kv_heads % tp == 0:
        return True
    return family_of(config).tp_replicated_kv and tp % kv_heads == 0


def _fails(value: int | list[int], tp: int) -> bool:
    return any(v % tp for v in value) if isinstance(value, list) else value % tp != 0


def valid_tp_sizes(config, *, vocab_parallel: bool = False) -> list[int]:
    """Every TP degree that divides all the sharded sizes of ``config`` and fits its KV heads ([1] when the
    model has no tensor-parallel support)."""
    if tp_refusal(config) is not None:
        return [1]
    common = 0
    for value in sharded_sizes(config, vocab_parallel=vocab_parallel).values():
        for v in value if isinstance(value, list) else [value]:
            common = gcd(common, v)
    kv = _kv_heads(config)
    return [tp for tp in _divisors(common or 1) if _kv_fits(config, kv, tp)]


def check_tp_sizes(config, tp: int, *, vocab_parallel: bool = False) -> None:
    """Raise ``ValueError`` when the model has no TP support (``tp > 1``) or ``tp`` does not divide a size
    that its plan shards.

    KV heads may be fewer than ``tp`` (MQA, narrow GQA) when ``tp`` is a multiple of them and the family has
    separate k/v projections: each rank then keeps a copy of the one KV head its query heads use.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if tp == 1:
        return
    check_tp_support(config)
    sizes = sharded_sizes(config, vocab_parallel=vocab_parallel)
    bad = {name: value for name, value in sizes.items() if _fails(value, tp)}
    kv = _kv_heads(config)
    kv_bad = not _kv_fits(config, kv, tp)
    if not bad and not kv_bad:
        return
    valid = valid_tp_sizes(config, vocab_parallel=vocab_parallel)
    problems = [f"tp={tp} does not divide {', '.join(f'{n}={v}' for n, v in bad.items())}"] if bad else []
    if kv_bad:
        replicable = family_of(config).tp_replicated_kv
        rule = "neither divides nor is divided by" if replicable else "is not divisible by"
        problems.append(f"num_key_value_heads={kv} {rule} tp={tp}")
    hint = ""
    if "vocab_size" in bad:
        hint = " (or pad the vocabulary to a multiple of tp, or set vocab_parallel=False)"
    raise ValueError(
        f"{'; '.join(problems)}; tensor parallelism splits heads, the MLP and (vocab-parallel) the vocabulary "
        f"evenly across the TP ranks. Use tp in {{{', '.join(map(str, valid))}}}{hint}"
    )

"""Size checks for tensor parallelism, run before any process group or parameter is touched.

Pure functions on a model config and a TP degree: every sharded dimension must divide evenly, and the
error says which value fails, the rule, and which TP degrees would work. Not for: building plans.
"""

from __future__ import annotations

from math import gcd


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sharded_sizes(config, *, vocab_parallel: bool) -> dict[str, int]:
    """The config values that TP splits evenly: ``{name: value}`` (heads, intermediate size, vocab)."""
    sizes = {"num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size}
    if vocab_parallel:
        sizes["vocab_size"] = config.vocab_size
    return sizes


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _kv_fits(kv_heads: int, tp: int) -> bool:
    """KV heads are split evenly (kv % tp == 0) or, fewer than the ranks, replicated (tp % kv == 0)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def valid_tp_sizes(config, *, vocab_parallel: bool = False) -> list[int]:
    """Every TP degree that divides all the sharded sizes of ``config`` and fits its KV heads."""
    common = 0
    for value in sharded_sizes(config, vocab_parallel=vocab_parallel).values():
        common = gcd(common, value)
    return [tp for tp in _divisors(common) if _kv_fits(_kv_heads(config), tp)]


def check_tp_sizes(config, tp: int, *, vocab_parallel: bool = False) -> None:
    """Raise ``ValueError`` when ``tp`` does not divide a size that TP shards.

    KV heads may be fewer than ``tp`` (MQA, narrow GQA) when ``tp`` is a multiple of them: each rank then
    keeps a copy of the one KV head its query heads use.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    sizes = sharded_sizes(config, vocab_parallel=vocab_parallel)
    bad = {name: value for name, value in sizes.items() if value % tp != 0}
    kv = _kv_heads(config)
    kv_bad = not _kv_fits(kv, tp)
    if not bad and not kv_bad:
        return
    valid = valid_tp_sizes(config, vocab_parallel=vocab_parallel)
    problems = [f"tp={tp} does not divide {', '.join(f'{n}={v}' for n, v in bad.items())}"] if bad else []
    if kv_bad:
        problems.append(f"num_key_value_heads={kv} neither divides nor is divided by tp={tp}")
    hint = ""
    if "vocab_size" in bad:
        hint = " (or pad the vocabulary to a multiple of tp, or set vocab_parallel=False)"
    raise ValueError(
        f"{'; '.join(problems)}; tensor parallelism splits heads, the MLP and (vocab-parallel) the vocabulary "
        f"evenly across the TP ranks. Use tp in {{{', '.join(map(str, valid))}}}{hint}"
    )

"""Size checks for tensor parallelism, run before any process group or parameter is touched.

Pure functions on a model config and a TP degree: every sharded dimension must divide evenly, and the
error says which value fails, the rule, and which TP degrees would work. Not for: building plans.
"""

from __future__ import annotations

from math import gcd


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sharded_sizes(config, *, vocab_parallel: bool) -> dict[str, int]:
    """The config values that TP splits: ``{name: value}`` (heads, kv heads, intermediate size, vocab)."""
    heads = config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
    }
    if vocab_parallel:
        sizes["vocab_size"] = config.vocab_size
    return sizes


def valid_tp_sizes(config, *, vocab_parallel: bool = False) -> list[int]:
    """Every TP degree that divides all the sharded sizes of ``config``."""
    common = 0
    for value in sharded_sizes(config, vocab_parallel=vocab_parallel).values():
        common = gcd(common, value)
    return _divisors(common)


def check_tp_sizes(config, tp: int, *, vocab_parallel: bool = False) -> None:
    """Raise ``ValueError`` when ``tp`` does not divide a size that TP shards."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    sizes = sharded_sizes(config, vocab_parallel=vocab_parallel)
    bad = {name: value for name, value in sizes.items() if value % tp != 0}
    if not bad:
        return
    valid = valid_tp_sizes(config, vocab_parallel=vocab_parallel)
    detail = ", ".join(f"{name}={value}" for name, value in bad.items())
    hint = ""
    if "vocab_size" in bad:
        hint = " (or pad the vocabulary to a multiple of tp, or set vocab_parallel=False)"
    raise ValueError(
        f"tp={tp} does not divide {detail}; tensor parallelism splits each of these evenly across the TP ranks. "
        f"Use tp in {{{', '.join(map(str, valid))}}}{hint}"
    )

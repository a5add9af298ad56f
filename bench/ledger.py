"""The step ledger per layout: one optimizer step's collectives, bytes and FLOPs beside their theoretical minimum.

    python bench/ledger.py [--layouts ddp fsdp2 zero3 tp tp_sp pp ep_fsdp2 cp] [--where]

2 gloo ranks, one spawn; the layouts, models and batches are ``tests/ledger_cases.py`` (optimizer step 3 of a
fresh ``DistTrainer`` each).

Per row: measured per rank (mean over ranks) / the minimum (``hf_dist.metrics.ledger_minimum``) for count and
bytes. Rows marked ``small`` are calls under 1 KiB (control: token counts, norms, stop flags, split sizes). FLOPs
are summed over ranks against ``6 x N_active x tokens + attention`` of the global batch. ``--where`` prints who
issued each collective. Not a test: ``tests/test_ledger.py`` pins the counts. Counts and bytes are exact and do
not depend on the machine's load; the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from ledger_cases import LAYOUTS, STEPS  # noqa: E402

LABELS = {"ddp": "DDP", "fsdp2": "FSDP2", "zero3": "ZeRO-3", "tp": "TP=2", "tp_sp": "TP=2+SP", "pp": "PP=2",
          "ep_fsdp2": "EP=2 x FSDP2", "cp": "CP=2"}
EXPLAINED: dict[tuple[str, str, bool, str], str] = {
    ("fsdp2", "all_gather", False, "float32"): "below 1: the head and the root stay gathered from forward to "
        "backward and the last block is not resharded after forward (hf_dist's prefetch): 7 gathers, not 10, the "
        "root's (the final norm alone) under 1 KiB",
    ("fsdp2", "reduce_scatter", False, "float32"): "count: the root's reduce-scatter (the final norm alone) is under "
        "1 KiB, a small row",
    ("fsdp2", "all_gather", True, "float32"): "the root's gather: the final norm alone (the head and the untied "
        "embedding are units of their own)",
    ("fsdp2", "reduce_scatter", True, "float32"): "the root's reduce-scatter: the final norm's gradient alone",
    ("ep_fsdp2", "all_gather", True, "float32"): "as FSDP2: the root's gather, the final norm alone",
    ("ep_fsdp2", "reduce_scatter", True, "float32"): "as FSDP2: the final norm's gradient alone",
    ("ep_fsdp2", "all_gather", False, "float32"): "below 1: as FSDP2, head, root and last block kept gathered",
    ("ep_fsdp2", "reduce_scatter", False, "float32"): "count: as FSDP2, the root's (final norm) is a small row",
    ("tp", "all_reduce", False, "float32"): "+1 beyond Megatron's per-block count: the lm_head's input gradient "
        "(a column-parallel head with gathered logits)",
    ("tp", "all_gather", False, "float32"): "the logits gathered over the vocabulary shards for the loss "
        "(tp_vocab_parallel=False; vocab-parallel loss avoids it)",
    ("tp_sp", "all_gather", False, "float32"): "+3 at the ends, beyond Megatron's per-block count: the head's "
        "input gathered over the sequence (forward), the whole embedding's input gradient gathered (backward), the "
        "logits gathered over the vocabulary shards (tp_vocab_parallel=False)",
    ("tp_sp", "reduce_scatter", False, "float32"): "+1: the head's input gradient scattered back to sequence shards",
    ("zero3", "all_gather", False, "float32"): "bytes 0.5: each parameter gathered once per step, kept from forward "
        "to backward (zero3.json's stage3_max_reuse_distance 1e9 spans the tiny model: at 0, 2 x bytes); count: "
        "DeepSpeed fetches per submodule (16 Linears and embeddings: 32 calls at reuse distance 0), not per block",
    ("zero3", "reduce_scatter", False, "float32"): "a bucket holds reduce_bucket_size = hidden^2 elements (HF's "
        "auto: 4,096 here), so every tensor but k+v travels alone (reduce_bucket_size 1e9: 1 call, 623,872 B)",
    ("zero3", "all_gather", True, "float32"): "the 5 norms (below stage3_param_persistence_threshold = 10 x hidden, "
        "whole on every rank) gathered again after the step, one call each",
    ("zero3", "reduce_scatter", True, "float32"): "the 5 norms' gradients, each its own bucket (the next tensor "
        "would overflow it)",
    ("zero3", "all_reduce", True, "float64"): "DeepSpeed's gradient norm, once per optimizer parameter group "
        "(decay / no decay); the clipping norm the minimum counts",
    ("pp", "send", False, "float32"): "the pipeline pads every batch to a multiple of 64 tokens "
        "(PipelineConfig.pad_to_multiple_of): 32 -> 64, twice the activations",
    ("pp", "recv", False, "float32"): "as send: 32-token rows padded to 64",
    ("pp", "all_reduce", True, "float32"): "+1: the loss handed from the last stage to every rank (_broadcast_loss)",
    ("ep_fsdp2", "all_to_all", True, "int64"): "the routed tokens' split sizes, exchanged before each dispatch",
    ("ep_fsdp2", "all_reduce", True, "float32"): "the clipping norm per mesh (dense and expert parameters): "
        "one value per parameter tensor, a sum would be 4 B",
    ("ddp", "broadcast", True, "float32"): "DDP re-broadcasts buffers (rotary inv_freq) every forward "
        "(the Trainer's ddp_broadcast_buffers default)",
    ("ddp", "all_reduce", True, "int32"): "+ the preemption flag; DDP all-reduces its used-parameter map (1 int32 "
        "per parameter) every step: the Trainer's ddp_find_unused_parameters default is True",
    ("*", "all_reduce", True, "int32"): "hf_dist's preemption check: did any rank get a signal? (4 B per step)",
    ("*", "all_reduce", True, "float32"): "the clipping norm: one value per parameter tensor in one call; a sum "
        "would be 4 B",
    ("*", "all_gather", True, "int64"): "the Trainer gathers the token count over every rank; tp/cp ranks share "
        "a batch, so the gather over dp alone would do",
    ("*", "FLOPs", False, ""): "CPU flash attention's backward recomputes the scores (5 matmuls; the formula "
        "counts 4)",
    ("pp", "FLOPs", False, ""): "rows padded from 32 to 64 tokens (see send)",
}
"""(layout or *, kind, small, dtype) -> why a ratio is not 1.0, from the measured run (--where names the callers)"""


def _explain(layout: str, kind: str, small: bool, dtype: str) -> str:
    return EXPLAINED.get((layout, kind, small, dtype)) or EXPLAINED.get(("*", kind, small, dtype), "")


def table(layout: str, per_rank: list[dict]) -> list[str]:
    """The printed rows of one layout."""
    from hf_dist.metrics.ledger_minimum import compare, measured_rows, minimum, ratio

    first = per_rank[0]
    rows = compare(measured_rows([r["ledger"] for r in per_rank]),
                   minimum(layout, first["shape"], dp=first["dp"], cp=first["cp"]))
    lines = []
    for row in rows:
        least = row.minimum
        c_min, b_min = (least.count, least.bytes) if least else (0, 0)
        count_ratio, bytes_ratio = ratio(row.count, c_min), ratio(row.bytes, b_min)
        off = "extra" in (count_ratio, bytes_ratio) or any(
            r not in ("-", "extra") and float(r) != 1.0 for r in (count_ratio, bytes_ratio))
        note = _explain(layout, row.kind, row.small, row.dtype) if off else ""
        kind = row.kind + (" small" if row.small else "")
        lines.append(f"{LABELS[layout]:<13}{kind:<21}{row.group.split('/')[-1]:<8}{row.dtype:<9}{row.count:>6g}"
                     f"{c_min:>5}{count_ratio:>7}{row.bytes:>11,.0f}{b_min:>11,}{bytes_ratio:>7}  {note}")
    flops = sum(r["ledger"]["flops"] for r in per_rank)
    flops_ratio = ratio(flops, first["min_flops"])
    lines.append(f"{LABELS[layout]:<13}{'FLOPs (all ranks)':<51}{flops:>11.4g}{first['min_flops']:>11.4g}"
                 f"{flops_ratio:>7}  {_explain(layout, 'FLOPs', False, '') if flops_ratio != '1.00' else ''}")
    led = first["ledger"]
    lines.append(f"{LABELS[layout]:<13}dtypes: params {'/'.join(led['param_dtypes'])}, grads "
                 f"{'/'.join(led['grad_dtypes']) or 'none on the parameters (kept in the engine)'}, "
                 f"loss {led['loss_dtype']}")
    return lines


def main() -> None:
    import tempfile

    import torch
    from dist_utils import run_distributed
    from ledger_cases import LAYOUTS, STEPS, ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--where", action="store_true", help="print who issued each collective")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf_dist_ledger_") as out:
        per_rank = run_distributed(ranks, 2, opts.layouts, out, opts.where, timeout_s=1800)
    print(f"\nstep ledger, optimizer step {STEPS}, 2 gloo ranks; per rank (mean over ranks) / minimum")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{'GPU' if torch.cuda.is_available() else 'no GPU'}; {datetime.date.today()}")
    print(f"{'layout':<13}{'kind':<21}{'group':<8}{'dtype':<9}{'count':>6}{'min':>5}{'ratio':>7}"
          f"{'bytes':>11}{'min':>11}{'ratio':>7}  why above 1")
    for layout in opts.layouts:
        for line in table(layout, [r[layout] for r in per_rank]):
            print(line)
        if opts.where:
            for key, tally in sorted(per_rank[0][layout]["ledger"]["comms"].items()):
                print(f"    {key.kind} {key.dtype}: " + ", ".join(f"{s} x{n}" for s, n in tally.sites.items()))


if __name__ == "__main__":
    main()

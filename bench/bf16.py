"""bf16 per layout: each layout's error against one fp32 process beside one bf16 process's error against it.

    python bench/bf16.py [--layouts ddp ddp_pure fsdp2 fsdp2_pure tp tp_sp pp cp ep_fsdp2 zero2 zero3]

2 gloo ranks, one spawn; the layouts, models, batch and optimizer are ``tests/bf16_cases.py`` (3 SGD-with-momentum
steps, global batch 4, tiny Llama / tiny Qwen3-MoE with its router aux loss on). For each layout trained with
``bf16=True`` (``pure_bf16``: on a model loaded in bf16): the largest loss difference over the steps and the largest
parameter difference after them, against the one-process fp32 run of the same model and batch, beside the same
figures of the one-process run in the same precision (``bf16=True`` on one process), and their ratio. Then the
preset the planner forecasts for the layout (``hf_dist.precision.precision_that_runs``) and whether the step
ledger's dtypes match that preset's record (``tensor_dtypes``). ``tests/test_bf16_layouts.py`` asserts both; the
figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from bf16_cases import LABELS, LAYOUTS, STEPS  # noqa: E402


def rows(refs: dict, per_rank: list[dict], layouts: list[str]) -> list[str]:
    from bf16_cases import dtype_mismatches, errors, forecast

    lines = []
    for layout in layouts:
        _, name, asked = LAYOUTS[layout]
        fp32, one = refs[(name, "fp32")], refs[(name, asked)]
        run = per_rank[0][layout]
        loss, param = errors(run, fp32)
        one_loss, one_param = errors(one, fp32)
        bad = [m for r in per_rank for m in dtype_mismatches(layout, r[layout])]
        lines.append(f"{LABELS[layout]:<17}{forecast(layout, run)[0]:<15}{loss:>10.2e}{one_loss:>10.2e}"
                     f"{loss / one_loss:>7.2f}{param:>11.2e}{one_param:>10.2e}{param / one_param:>7.2f}  "
                     f"{'yes' if not bad else 'NO: ' + '; '.join(bad)}")
    return lines


def main() -> None:
    import tempfile

    import torch
    from bf16_cases import ranks, references
    from dist_utils import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf_dist_bf16_") as out:
        refs = references(out, opts.layouts)
        per_rank = run_distributed(ranks, 2, opts.layouts, out, timeout_s=1800)
    print(f"\nbf16 per layout, 2 gloo ranks, {STEPS} SGD steps; error = largest |difference| against one fp32 process")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{'GPU' if torch.cuda.is_available() else 'no GPU'}; torch {torch.__version__}; {datetime.date.today()}")
    print(f"{'layout':<17}{'preset':<15}{'loss err':>10}{'1 proc':>10}{'ratio':>7}{'param err':>11}{'1 proc':>10}"
          f"{'ratio':>7}  dtypes as forecast")
    for line in rows(refs, per_rank, opts.layouts):
        print(line)
    for (name, precision), run in sorted(refs.items()):
        if precision == "fp32":  # the scale of a defect: a wrong gradient is off by about an update
            change = max((p - run["initial"][k]).abs().max().item() for k, p in run["params"].items())
            print(f"largest parameter change of the fp32 run, {name}: {change:.2e}")


if __name__ == "__main__":
    main()

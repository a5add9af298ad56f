"""Coverage table: for every causal-LM model type of the installed transformers, whether hf_dist runs it with
tensor parallelism, pipeline parallelism, (MoE types) expert parallelism and context parallelism, and why not where
it does not; then expert parallelism combined with TP, PP and CP (each product its own registry cell); then how
context parallelism runs on the types it runs (``hf_dist.context_parallel.support``, the check
DistTrainer makes with ``cp_size > 1``).

The statuses are the support decisions themselves (``hf_dist.tensor_parallel.support``,
``hf_dist.pipeline_parallel.support``, ``hf_dist.expert_parallel.support`` and ``hf_dist.context_parallel.support``)
on each type's default config; "yes" means the type passed its parity test against one process
(tests/test_tp_sweep.py, tests/test_moe_tp.py for MoE TP, the PP sweep for PP, tests/test_expert_parallel.py for EP,
tests/test_context_parallel.py and tests/test_moe_cp.py for CP; "-": a dense model). Where a type's default config is
refused at degree 2, the note gives the reason ``hf_dist.support.model_refusals`` gives (the run's own answer;
``tests/test_coverage_doc.py`` checks every cell against it). Nothing is run here.

    python bench/coverage.py                      # print the table
    python bench/coverage.py --write docs/coverage.md --readme README.md   # also write the table, README counts

Not a test and not a benchmark of speed: a table of decisions.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import re
import sys
import warnings
from types import SimpleNamespace


def _pp_status() -> dict[str, str]:
    """PP decision per model type: the PP module's own table where it has one, else its check on defaults."""
    from hf_dist.pipeline_parallel import support

    if hasattr(support, "pipeline_coverage"):
        return support.pipeline_coverage()
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    table = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            support.check_pipeline_support(AutoConfig.for_model(model_type))
            table[model_type] = "yes"
        except Exception as error:  # noqa: BLE001 - the refusal (or a config that cannot be built) is the note
            table[model_type] = str(error).split(";")[0]
    return table


def _short(reason: str) -> str:
    """The reason without naming the model type again (the row says it)."""
    reason = re.sub(r"\s*(for )?model_type='[^']*'( (is|has|declares))?:?\s*", " ", reason)
    reason = " ".join(reason.split())
    return reason if len(reason) <= 160 else reason[:157] + "..."


def default_refusal(model_type: str, parallelism: str) -> str | None:
    """What a run says of ``model_type``'s default config with ``parallelism`` at 2 (a product such as ``ep_tp``:
    each factor at 2) and the others at 1: the first reason of ``hf_dist.support.model_refusals`` (the entry point
    the trainer, the loader, the planner and ``hf-dist config`` ask); ``None`` when it runs, or when the default
    config cannot be built."""
    from transformers import AutoConfig

    from hf_dist.support import model_refusals

    factors = parallelism.split("_")
    degrees = {p: 2 if p in factors else 1 for p in ("tp", "pp", "ep", "cp")}
    layout = SimpleNamespace(**degrees, vocab_parallel=False)
    try:
        reasons = model_refusals(AutoConfig.for_model(model_type), layout)
    except Exception:  # noqa: BLE001 - a default config that cannot be built says nothing more
        return None
    return reasons[0] if reasons else None


def _default_layout_note(model_type: str) -> str | None:
    """For a TP-supported type whose default config no TP degree fits (multi-query Falcon, StarCoder 1): why."""
    from transformers import AutoConfig

    from hf_dist.tensor_parallel.checks import valid_tp_sizes

    try:
        if valid_tp_sizes(AutoConfig.for_model(model_type)) != [1]:
            return None
    except Exception:  # noqa: BLE001 - a default config that cannot be built says nothing more
        return None
    why = default_refusal(model_type, "tp")
    return f"TP: its default config is refused ({why.split('; tensor parallelism splits')[0]})" if why else None


def _default_ep_note(model_type: str) -> str | None:
    """For an EP-proven type whose default config EP=2 refuses (its expert count, or none): why."""
    why = default_refusal(model_type, "ep")
    return f"EP: its default config is refused ({_short(why)})" if why else None


def _cp_status(model_type: str) -> str:
    """CP decision: ``"yes"`` (its record proves CP), else what the run says of the default config with cp=2 (up to
    its fix), or the record's reason when the default config cannot be built."""
    from hf_dist.context_parallel.support import cp_refusal
    from hf_dist.families import family

    if family(model_type).proves("cp"):
        return "yes"
    why = default_refusal(model_type, "cp") or cp_refusal(SimpleNamespace(model_type=model_type), 2)
    return why.split(";")[0]


def coverage_rows() -> list[tuple[str, str, str, str, str, str]]:
    """``(model type, TP, PP, EP, CP, note)`` for every causal-LM model type, sorted by type."""
    from hf_dist.expert_parallel.support import ep_coverage
    from hf_dist.tensor_parallel.support import tp_coverage

    tp, pp, ep = tp_coverage(), _pp_status(), ep_coverage()
    rows = []
    for model_type in sorted(tp):
        tp_reason, pp_reason = tp[model_type], pp.get(model_type, "not decided")
        ep_reason = ep.get(model_type, "not decided")
        notes = []
        if tp_reason != "yes":
            notes.append(f"TP: {_short(tp_reason)}")
        elif note := _default_layout_note(model_type):
            notes.append(note)
        if pp_reason != "yes" and pp_reason != tp_reason:
            notes.append(f"PP: {_short(pp_reason)}")
        if ep_reason not in ("yes", "dense"):
            notes.append(f"EP: {_short(ep_reason)}")
        elif ep_reason == "yes" and (note := _default_ep_note(model_type)):
            notes.append(note)
        ep_cell = "yes" if ep_reason == "yes" else "-" if ep_reason == "dense" else "no"
        if (cp_reason := _cp_status(model_type)) != "yes":
            notes.append(f"CP: {_short(cp_reason)}")
        rows.append((model_type, "yes" if tp_reason == "yes" else "no", "yes" if pp_reason == "yes" else "no",
                     ep_cell, "yes" if cp_reason == "yes" else "no", "; ".join(notes)))
    return rows


def render(rows: list[tuple[str, str, str, str, str, str]]) -> str:
    """A markdown table with a one-line summary above it."""
    import torch
    import transformers

    tp_yes = sum(row[1] == "yes" for row in rows)
    pp_yes = sum(row[2] == "yes" for row in rows)
    ep_yes, moe = sum(row[3] == "yes" for row in rows), sum(row[3] != "-" for row in rows)
    cp_yes = sum(row[4] == "yes" for row in rows)
    lines = [
        f"{len(rows)} causal-LM model types in transformers {transformers.__version__} (torch {torch.__version__}); "
        f"TP supported: {tp_yes}, PP supported: {pp_yes}, EP supported: {ep_yes} of {moe} MoE types, CP supported: "
        f"{cp_yes}. Generated by "
        f"`python bench/coverage.py --write docs/coverage.md --readme README.md` on "
        f"{datetime.date.today().isoformat()}.",
        "",
        "| model type | TP | PP | EP | CP | note |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {tp} | {pp} | {ep} | {cp} | {note.replace('|', '/')} |" for t, tp, pp, ep, cp, note in rows]
    return "\n".join(lines) + "\n"


def render_context_parallel() -> str:
    """The context-parallel section: the types ``CP_MODEL_TYPES`` lists; every other type is refused by name."""
    from hf_dist.context_parallel.support import cp_support_table

    return ("\n## Context parallelism\n\n`cp_size > 1` runs these model types (all-to-all attention around the "
            "model's own attention; heads and KV heads must divide by `cp_size`). Every other model type is refused "
            "by name before launch (`hf_dist.context_parallel.support.check_cp_support`).\n\n"
            + cp_support_table() + "\n")


PRODUCTS = ("ep_tp", "ep_pp", "ep_cp")
"""Expert parallelism combined with another parallelism: a cell of its own in the registry (a product is proven by
its own parity test, not by its factors')."""


def product_rows(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """``(model type, EP x TP, EP x PP, EP x CP, note)`` for every MoE type EP runs (``rows``: ``coverage_rows()``): "yes" where its record proves the
    product, else "no" with the run's reason for the default config (each factor at 2)."""
    from hf_dist.families import family

    out = []
    for model_type, tp, pp, ep, cp, _note in rows:
        if ep != "yes":
            continue
        cells, notes = [], []
        for product, factor in zip(PRODUCTS, (tp, pp, cp)):
            if family(model_type).proves(product):
                cells.append("yes")
                continue
            cells.append("no")
            name = product.upper().replace("_", " x ")
            if factor != "yes":
                notes.append(f"{name}: {product[3:].upper()} alone is refused")
            elif (why := default_refusal(model_type, product)) is not None:
                notes.append(f"{name}: {_short(why.split(';')[0])}")
        out.append((model_type, *cells, "; ".join(notes)))
    return out


def render_products(rows: list[tuple[str, ...]]) -> str:
    """The section for expert parallelism combined with TP, PP and CP."""
    counts = ", ".join(f"{p.upper().replace('_', ' x ')}: {sum(r[i + 1] == 'yes' for r in rows)}"
                       for i, p in enumerate(PRODUCTS))
    shown = [row for row in rows if "yes" in row[1:-1] or row[-1].count("alone is refused") < len(PRODUCTS)]
    rest = sorted(row[0] for row in rows if row not in shown)
    lines = ["", "## Expert parallelism combined with TP, PP and CP", "",
             f"Of the {len(rows)} MoE types EP runs, each product at degree 2 x 2 ({counts}). A product needs its own "
             "parity test: \"no\" gives the run's reason for the default config (the registry's cells `ep_tp`, "
             "`ep_pp`, `ep_cp`; `tests/test_coverage_doc.py` checks every cell against the run). Not in the table, "
             f"every product refused because TP, PP and CP alone are refused (table above): {', '.join(rest)}.", "",
             "| model type | EP x TP | EP x PP | EP x CP | note |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row[:-1])} | {row[-1].replace('|', '/')} |" for row in shown]
    return "\n".join(lines) + "\n"


def render_all() -> str:
    """Everything ``docs/coverage.md`` holds below its title."""
    rows = coverage_rows()
    return render(rows) + render_products(product_rows(rows)) + render_context_parallel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="also write the table to this markdown file")
    parser.add_argument("--readme", help="also replace the summary line (the counts) between the coverage markers "
                        "of this file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    body = render_all()
    sys.stdout.write(body)
    if args.write:
        header = "# Model coverage: tensor, pipeline, expert and context parallelism per model type\n\n"
        with open(args.write, "w") as handle:
            handle.write(header + body)
    if args.readme:
        write_between_markers(args.readme, body.splitlines()[0] + "\n")


START, END = "<!-- coverage table: start -->", "<!-- coverage table: end -->"


def write_between_markers(path: str, table: str) -> None:
    """Replace what stands between ``START`` and ``END`` in ``path`` (both markers must be there, once)."""
    with open(path) as handle:
        text = handle.read()
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{path} must hold the lines {START!r} and {END!r} once each")
    head, rest = text.split(START)
    tail = rest.split(END)[1]
    with open(path, "w") as handle:
        handle.write(f"{head}{START}\n{table}{END}{tail}")


if __name__ == "__main__":
    main()

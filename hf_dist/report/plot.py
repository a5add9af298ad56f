"""Draw a run's loss, throughput, memory and step-time curves to one PNG (``hf-dist report RUN_DIR``).

Reads the log dicts ``read_log_history`` finds and, if present, the ``summary.json`` the Harbor recipe writes
(its layout and perplexities go in the title). Each panel is drawn only when its keys are in the logs, and
``draw_report`` returns the titles it drew so callers (and tests) know what the image holds. Not an
experiment tracker: one run, one image, no comparison across runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hf_dist.report.log_history import read_log_history

PANEL_LOSS = "loss"
PANEL_THROUGHPUT = "throughput (tokens/s)"
PANEL_MEMORY = "peak memory per rank (GiB)"
PANEL_STEP_TIME = "busy time per micro step (s)"
_RANK_KEY = re.compile(r"^(?P<name>.+)/rank(?P<rank>\d+)$")


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and "step" in r]
    return [p[0] for p in points], [p[1] for p in points]


def _per_rank(records: list[dict], name: str) -> dict[int, str]:
    keys = {key for r in records for key in r}
    ranks = {}
    for key in keys:
        match = _RANK_KEY.match(key)
        if match and match["name"] == name:
            ranks[int(match["rank"])] = key
    return dict(sorted(ranks.items()))


def _loss_panel(ax, records: list[dict]) -> None:
    ax.plot(*_series(records, "loss"), marker="o", ms=3, label="train loss")
    eval_keys = sorted({k for r in records for k in r if k.endswith("_loss") and k != "train_loss"})
    for key in eval_keys:
        ax.plot(*_series(records, key), marker="s", ls="--", label=key)
    ax.set_xlabel("optimizer step")
    ax.legend(fontsize=7)


def _throughput_panel(ax, records: list[dict]) -> None:
    ax.plot(*_series(records, "tokens_per_second"), marker="o", ms=3, color="tab:green", label="tokens/s (cluster)")
    ax.set_xlabel("optimizer step")
    steps, mfu = _series(records, "mfu")
    if mfu:
        twin = ax.twinx()
        twin.plot(steps, [100 * m for m in mfu], ls="--", color="tab:purple", label="MFU (%)")
        twin.set_ylabel("MFU (%)")
    ax.legend(fontsize=7, loc="lower right")


def _rank_panel(ax, records: list[dict], name: str, extra: str | None = None) -> None:
    for rank, key in _per_rank(records, name).items():
        ax.plot(*_series(records, key), marker="o", ms=3, label=f"rank {rank}")
    if extra is not None:
        steps, values = _series(records, extra)
        if values:
            ax.plot(steps, values, ls=":", color="black", label=extra.replace("_", " "))
    ax.set_xlabel("optimizer step")
    ax.legend(fontsize=7, ncol=2)


def _title(run_dir: Path) -> str:
    title = str(run_dir)
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if summary.get("layout"):
            words = summary["layout"].split()  # train.py keeps the table's row label: "layout  DDP (...)"
            title += "\n" + " ".join(words[1:] if words[0] == "layout" else words)
        if summary.get("perplexity_after") is not None:
            title += f" | eval perplexity {summary['perplexity_before']:.2f} -> {summary['perplexity_after']:.2f}"
    return title


def draw_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the PNG (default ``RUN_DIR/report.png``); return its path and the titles of the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_log_history(run_dir)
    panels = []
    if any(r.get("loss") is not None for r in records):
        panels.append((PANEL_LOSS, lambda ax: _loss_panel(ax, records)))
    if any("tokens_per_second" in r for r in records):
        panels.append((PANEL_THROUGHPUT, lambda ax: _throughput_panel(ax, records)))
    if _per_rank(records, "peak_memory_gb"):
        panels.append((PANEL_MEMORY, lambda ax: _rank_panel(ax, records, "peak_memory_gb")))
    if _per_rank(records, "busy_seconds"):
        panels.append((PANEL_STEP_TIME, lambda ax: _rank_panel(ax, records, "busy_seconds", "comm_wait_seconds")))
    if not panels:
        raise ValueError(f"the logs in {str(run_dir)!r} have no training loss to draw; did the run log any step?")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, draw) in zip(axes[0], panels):
        draw(ax)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.suptitle(_title(run_dir), fontsize=9)
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out, [title for title, _ in panels]

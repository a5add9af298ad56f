"""docs/coverage.md and the README's coverage counts are what the registry and the support decisions say today.

The table is regenerated from the code (``bench/coverage.py``: each type's default config through the same
refusals the run makes) and compared with the committed files, the generation date aside. A support change that
is not written into the docs fails here; regenerate with
``python bench/coverage.py --write docs/coverage.md --readme README.md``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r" on \d{4}-\d{2}-\d{2}\.")


def _coverage_module():
    spec = importlib.util.spec_from_file_location("bench_coverage", ROOT / "bench" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> str:
    import transformers

    doc = (ROOT / "docs" / "coverage.md").read_text()
    if f"transformers {transformers.__version__} " not in doc:
        pytest.skip(f"docs/coverage.md was generated for another transformers than {transformers.__version__}")
    coverage = _coverage_module()
    return coverage.render_all()


def test_coverage_doc_is_the_registry_today(generated):
    doc = (ROOT / "docs" / "coverage.md").read_text()
    body = doc.split("\n\n", 1)[1]  # after the title
    assert DATE.sub(" on DATE.", body) == DATE.sub(" on DATE.", generated)


def test_readme_counts_are_the_registry_today(generated):
    readme = (ROOT / "README.md").read_text()
    summary = readme.split("<!-- coverage table: start -->\n")[1].split("<!-- coverage table: end -->")[0]
    assert DATE.sub(" on DATE.", summary.strip()) == DATE.sub(" on DATE.", generated.splitlines()[0])


def test_the_table_and_the_runs_answer_on_each_default_config_agree(generated):
    """Every TP / PP / EP / CP cell against ``hf_dist.support.model_refusals`` (what the trainer, the loader, the planner
    and ``hf-dist config`` ask) on the type's default config at degree 2: "yes" without a default-config note is
    exactly a layout the run accepts."""
    from transformers import AutoConfig

    coverage = _coverage_module()
    disagree = []
    for model_type, tp, pp, ep, cp, note in coverage.coverage_rows():
        try:
            AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - no default config: nothing for the run to answer
            continue
        for parallelism, cell in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
            table_runs = cell == "yes" and f"{parallelism.upper()}: its default config is refused" not in note
            run_runs = coverage.default_refusal(model_type, parallelism) is None
            if table_runs != run_runs:
                disagree.append((model_type, parallelism, cell, coverage.default_refusal(model_type, parallelism)))
    assert disagree == []


def test_each_product_cell_and_the_runs_answer_agree(generated):
    """Every EP x TP / EP x PP / EP x CP cell against ``model_refusals`` with both factors at 2 on the type's default
    config: "yes" is exactly a product the run accepts, and the table holds every type EP runs."""
    coverage = _coverage_module()
    rows = coverage.coverage_rows()
    products = coverage.product_rows(rows)
    assert {row[0] for row in products} == {row[0] for row in rows if row[3] == "yes"}
    disagree = []
    for model_type, *cells, _note in products:
        for product, cell in zip(coverage.PRODUCTS, cells):
            run_runs = coverage.default_refusal(model_type, product) is None
            if (cell == "yes") != run_runs:
                disagree.append((model_type, product, cell, coverage.default_refusal(model_type, product)))
    assert disagree == []

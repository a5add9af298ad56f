"""The bench scripts (and the examples) still call what exists: no test runs the benches whole (they take minutes
and print tables), so a helper moved or renamed elsewhere broke them silently (2026-11-28: ``bench/moe.py`` called
``native._common`` after it moved to ``tests/native_cases.py``; ``bench/loading.py`` imported ``trainer_dims``, gone
from ``hf_dist.trainer.trainer``). Each script's source is read, not run: every ``from M import name`` of hf_dist or
a sibling module (``bench/``, ``tests/``), wherever it sits (imports inside functions too), and every ``M.name`` read
from such a module imported whole, must exist."""

from __future__ import annotations

import ast
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("bench", "tests")
SIBLINGS = {f[:-3] for d in FOLDERS for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")}
SCRIPTS = sorted([os.path.join(d, f) for d in FOLDERS for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")]
                 + [os.path.relpath(os.path.join(top, f), ROOT)
                    for top, _, files in os.walk(os.path.join(ROOT, "examples")) for f in files if f.endswith(".py")])


def _ours(module: str | None) -> bool:
    return bool(module) and (module in SIBLINGS or module == "hf_dist" or module.startswith("hf_dist."))


def missing_names(path: str) -> list[str]:
    """``line: what`` for each name the file at ``path`` takes from hf_dist or a sibling that does not exist."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    whole: dict[str, str] = {}
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            whole.update({a.asname or a.name: a.name for a in node.names if _ours(a.name) and "." not in a.name})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:  # a submodule: ``from hf_dist import planner``
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in whole:
            if not hasattr(importlib.import_module(whole[node.value.id]), node.attr):
                missing.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return missing


@pytest.fixture(autouse=True)
def _siblings_importable(monkeypatch):
    for folder in FOLDERS:
        monkeypatch.syspath_prepend(os.path.join(ROOT, folder))


@pytest.mark.parametrize("path", SCRIPTS)
def test_names_taken_from_hf_dist_and_siblings_exist(path):
    assert missing_names(path) == []


def test_the_check_finds_a_moved_helper(tmp_path, monkeypatch):
    """The check itself: a script reading a helper its sibling no longer has, and importing a function hf_dist
    does not define, is caught."""
    script = tmp_path / "bench_probe.py"
    script.write_text("import native_cases\n\ndef main():\n    from hf_dist.loss.policy import no_such_rule\n"
                      "    return native_cases._common(1), native_cases.dataset\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert missing_names("bench_probe.py") == ["4: from hf_dist.loss.policy import no_such_rule",
                                               "5: native_cases._common"]

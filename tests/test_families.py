"""The model-family registry is the one source of what runs (pure: configs only, no process group).

- Generated over every causal-LM model type of the installed transformers x each cell of the registry (tp=2,
  pp=2, ep=2, cp=2, and ep=2 x pp=2): a cell the run accepts (``hf_dist.support.model_refusals``, which DistTrainer,
  ``from_pretrained``, the recipe and the planner ask) is a cell the registry proves; the planner's shape rule gives
  the same answer as the run for the same config.
- Every proven cell has its parity case in the test the record names (the CP, TP-MoE, EP and PP lists of cases
  are checked against the registry, so a type cannot be declared proven without a case).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

from hf_dist.families import FAMILIES, PARALLELISMS, Family, family, proven_types
from hf_dist.support import model_refusals

SIZES = {"tp": dict(tp=2), "pp": dict(pp=2), "ep": dict(ep=2), "cp": dict(cp=2), "ep_pp": dict(ep=2, pp=2)}
"""The sizes of each registry cell (``PARALLELISMS``): one parallelism, or a product of two."""


def _layout(parallelism: str):
    sizes = dict(tp=1, pp=1, ep=1, cp=1) | SIZES[parallelism]
    return SimpleNamespace(**sizes, vocab_parallel=False)


@functools.lru_cache(maxsize=None)
def _default_config(model_type: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a type whose default config cannot be built cannot be accepted either
        return None


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_a_cell_the_run_accepts_is_a_cell_the_registry_proves(parallelism):
    accepted_unproven = []
    for model_type in _causal_lm_types():
        config = _default_config(model_type)
        if config is None:
            continue
        if not model_refusals(config, _layout(parallelism)) and not family(config.model_type).proves(parallelism):
            accepted_unproven.append(model_type)
    assert accepted_unproven == []


@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_the_run_accepts_proven_types_on_their_defaults_or_says_why(parallelism):
    """A proven type is refused on its default config only for a size or field reason (or a MoE variant of a type
    proven dense), never as an unproven type."""
    unproven = ("has no PP parity case", "no TP parity test in hf_dist for", "but no EP parity case",
                "has no context-parallel parity test", "has no EP x PP parity case")
    for model_type in sorted(proven_types(parallelism)):
        config = _default_config(model_type)
        for reason in model_refusals(config, _layout(parallelism)):
            assert not any(text in reason for text in unproven), (model_type, reason)


def test_the_planner_asks_the_run():
    from hf_dist.planner.catalogue import MODEL_CATALOGUE, spec_config
    from hf_dist.planner.chooser import _shape_rule
    from hf_dist.planner.workload import make_layout

    checked = 0
    for spec in MODEL_CATALOGUE.values():
        for fields in (dict(tp=2), dict(pp=2), dict(cp=2), dict(ep=2)):
            try:
                layout = make_layout("fsdp_full_shard", 8, **fields)
            except (TypeError, ValueError):
                continue
            run = model_refusals(spec_config(spec), layout)
            plan = _shape_rule(spec, layout)
            assert (plan is None) == (not run), (spec.name, fields, plan, run)
            checked += 1
    assert checked >= 3 * len(MODEL_CATALOGUE)


def test_every_proven_cell_has_its_case():
    from ep_cases import CASES, SWEEP_CASES
    from test_context_parallel import MODELS as CP_CASES
    from test_moe_tp import TP_CASES

    assert set(CP_CASES) == proven_types("cp")
    assert set(TP_CASES) == proven_types("tp", kinds=("moe",))
    assert set(CASES + SWEEP_CASES) == proven_types("ep")
    from test_ep_pp import CASES as EP_PP_CASES

    assert set(EP_PP_CASES) == proven_types("ep_pp")
    for record in FAMILIES.values():
        for parallelism, test in record.proven.items():
            assert test.startswith("tests/test_") and test.endswith(".py"), (record.model_type, test)


def test_records_refuse_contradictions_and_unknown_types_prove_nothing():
    with pytest.raises(ValueError, match="both proven and refused"):
        Family(model_type="x", kind="dense", proven={"tp": "tests/test_x.py"}, refused={"tp": "no"})
    with pytest.raises(ValueError, match="parallelisms are"):
        Family(model_type="x", kind="dense", proven={"sp": "tests/test_x.py"})
    unknown = family("not_a_model_type")
    assert unknown.kind == "unknown" and not any(unknown.proves(p) for p in PARALLELISMS)


def test_no_support_decision_outside_the_registry_names_a_model_type():
    """The support modules of each parallelism hold no list of model types: they read the registry."""
    import pathlib
    import re

    import hf_dist

    root = pathlib.Path(hf_dist.__file__).parent
    pattern = re.compile(r"(?<!for )model_type *(==|in |not in )")
    offenders = []
    for folder in ("tensor_parallel/support.py", "pipeline_parallel/support.py", "expert_parallel/support.py",
                   "context_parallel/support.py", "support.py", "pipeline_parallel/plans.py"):
        for number, line in enumerate((root / folder).read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{folder}:{number}: {line.strip()}")
    assert offenders == []


def test_tp_plan_source_is_hf_dists_exactly_where_hf_dist_writes_a_plan():
    """``Family.tp_plan == "hf_dist"`` for the types with a plan in classic.py / moe.py (and codegen, refused by
    name), "model" for every other: which plan runs is the registry's choice, not whether transformers ships one."""
    from hf_dist.families import FAMILIES
    from hf_dist.tensor_parallel.classic import CLASSIC_TP
    from hf_dist.tensor_parallel.moe import OWN_PLANS

    own = {t for t, f in FAMILIES.items() if f.tp_plan == "hf_dist"}
    assert own - {"codegen"} == set(CLASSIC_TP) | set(OWN_PLANS)
    assert "tp" in FAMILIES["codegen"].refused

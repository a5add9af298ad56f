"""The model-family registry is the one source of what runs (pure: configs only, no process group).

- Generated over every causal-LM model type of the installed transformers x each cell of the registry (tp=2, pp=2,
  ep=2, cp=2, ep=2 x pp=2, ep=2 x cp=2 and ep=2 x tp=2): a cell the run accepts (``hf_dist.support.model_refusals``,
  which DistTrainer, ``from_pretrained``, the recipe and the planner ask) is a cell the registry proves; the
  planner's shape rule gives the same answer as the run for the same config.
- Every proven cell has its parity case in the test the record names (the CP, TP-MoE, EP and PP lists of cases
  are checked against the registry, so a type cannot be declared proven without a case).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest

from hf_dist.families import FAMILIES, PARALLELISMS, Family, family, proven_types
from hf_dist.support import model_refusals

SIZES = {"tp": dict(tp=2), "pp": dict(pp=2), "ep": dict(ep=2), "cp": dict(cp=2), "ep_pp": dict(ep=2, pp=2),
         "ep_cp": dict(ep=2, cp=2), "ep_tp": dict(ep=2, tp=2)}
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
                "has no context-parallel parity test", "has no EP x PP parity case", "has no EP x CP parity case",
                "has no EP x TP parity case")
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


def test_every_proven_cell_has_its_case_and_no_case_is_unclaimed():
    """The parity matrix, generated from the harness's case lists: exactly the registry's proven cells, each run by
    the test file its record names."""
    from parity import matrix

    proven = {(t, p): test for t, record in FAMILIES.items() for p, test in record.proven.items()}
    cells = matrix()
    assert sorted(set(proven) - set(cells)) == [], "proven without a parity case"
    assert sorted(set(cells) - set(proven)) == [], "a parity case the registry does not claim"
    assert {cell: proven[cell] for cell in cells} == cells, "a record names another test than the one that runs it"
    for test in set(proven.values()):
        assert test.startswith("tests/test_") and test.endswith(".py"), test


def test_every_parity_case_sets_the_fields_the_registry_says_matter():
    """Each case's tiny config moves every field group its record's ``parity_fields`` names (routed experts per token
    and the aux-loss coefficient of a MoE config, a sliding window where the type has one) off its default, except
    the gaps ``LEFT_AT_DEFAULT`` lists; a closed gap must leave the list."""
    from parity import LEFT_AT_DEFAULT, cases, default_fields, tiny_config

    found = {}
    for parallelism in ("tp", "pp", "ep", "ep_pp", "ep_tp"):  # cp: test_context_parallel's long-sequence configs
        for names in cases(parallelism).values():
            for case in names:
                missing = default_fields(tiny_config(case, parallelism))
                if missing:
                    found[(case, parallelism)] = tuple(missing)
    assert found == LEFT_AT_DEFAULT


def test_the_field_check_sees_a_case_on_defaults():
    from parity import default_fields
    from transformers import AutoConfig

    assert default_fields(AutoConfig.for_model("mixtral")) == ["router", "aux loss", "window"]
    assert default_fields(AutoConfig.for_model("mistral", sliding_window=8)) == []
    assert "router" not in default_fields(AutoConfig.for_model("zaya"))  # its code fixes top-1 (the registry says)


def test_records_refuse_contradictions_and_unknown_types_prove_nothing():
    with pytest.raises(ValueError, match="both proven and refused"):
        Family(model_type="x", kind="dense", proven={"tp": "tests/test_x.py"}, refused={"tp": "no"})
    with pytest.raises(ValueError, match="parallelisms are"):
        Family(model_type="x", kind="dense", proven={"sp": "tests/test_x.py"})
    unknown = family("not_a_model_type")
    assert unknown.kind == "unknown" and not any(unknown.proves(p) for p in PARALLELISMS)


def _model_type_decisions(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every place in ``source`` that decides by a model-type name: a comparison or membership
    test of a ``model_type`` value, a lookup keyed by one (``table[config.model_type]``, ``.get(model_type)``), a
    model-type string compared with anything, and a dict, set, tuple or list literal holding model-type strings."""
    import ast

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    names = set(CONFIG_MAPPING_NAMES) | set(FAMILIES)

    def is_type_string(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def mentions_model_type(node) -> bool:
        """Whether ``node`` reads a model type, other than to ask the registry for its record."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("family", "family_of"):
            return False
        if isinstance(node, ast.Name) and "model_type" in node.id:
            return True
        if isinstance(node, ast.Attribute) and node.attr == "model_type":
            return True
        if isinstance(node, ast.Constant) and node.value == "model_type":  # getattr(config, "model_type", None)
            return True
        return any(mentions_model_type(child) for child in ast.iter_child_nodes(node))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_type_string(side) for side in sides) or (
                    any(mentions_model_type(side) for side in sides)
                    and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)):
                found.append((node.lineno, "comparison"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and mentions_model_type(node.slice):
            found.append((node.lineno, "lookup by model_type"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and mentions_model_type(node.args[0])):
            found.append((node.lineno, ".get(model_type)"))
        elif isinstance(node, ast.Dict) and any(is_type_string(k) for k in node.keys if k is not None):
            found.append((node.lineno, "dict keyed by model types"))
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)) and any(is_type_string(e) for e in node.elts):
            found.append((node.lineno, "collection of model types"))
    return found


def test_the_scan_finds_each_form_of_model_type_decision():
    """The scan below would catch each way of deciding by model type (a check that cannot fail is no check)."""
    forms = [
        'if config.model_type == "gpt_oss": pass',
        'x = model_type in ("llama", "mistral")',
        'x = getattr(config, "model_type", None) not in SUPPORTED',
        'x = PLANS[config.model_type]',
        'x = PLANS.get(getattr(config, "model_type", None), {})',
        'PLANS = {"gpt2": 1}',
        'TYPES = ("qwen3_moe", "mixtral")',
        'x = name == "qwen2"',
    ]
    for form in forms:
        assert _model_type_decisions(form), form
    clean = ('record = family(getattr(config, "model_type", None))\nmsg = f"model_type={config.model_type!r}"\n'
             'table[model_type] = "yes"\nif family(config.model_type).planner is None: pass')
    assert _model_type_decisions(clean) == []


def test_no_code_outside_the_registry_decides_by_model_type():
    """Outside ``hf_dist/families/`` no module of hf_dist compares, looks up or lists model types: what hf_dist
    knows about a type (plans, overlays, the planner's shapes, support) is a field of its registry record."""
    import pathlib

    import hf_dist

    root = pathlib.Path(hf_dist.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "families":
            continue
        offenders += [f"{path.relative_to(root)}:{line}: {what}"
                      for line, what in _model_type_decisions(path.read_text())]
    assert offenders == []


def test_tp_plan_source_is_hf_dists_exactly_where_hf_dist_writes_a_plan():
    """``Family.tp_plan == "hf_dist"`` for the types whose records carry hf_dist's plan (and codegen, refused by
    name), "model" for every other: which plan runs is the registry's choice, not whether transformers ships one."""
    from hf_dist.families import FAMILIES, types_with

    own = {t for t, f in FAMILIES.items() if f.tp_plan == "hf_dist"}
    assert own - {"codegen"} == set(types_with("tp_classic")) | set(types_with("tp_base_plan"))
    assert "tp" in FAMILIES["codegen"].refused


@pytest.mark.parametrize("model_type", sorted(t for t, f in FAMILIES.items() if f.planner is not None))
@pytest.mark.parametrize("attention_bias", [False, True])
def test_the_planners_shape_of_each_type_is_the_built_model(model_type, attention_bias):
    """``hf-dist plan`` on a local config of a type whose record has a ``planner`` shape counts exactly the
    parameters the model builds (per layer, and in all), biases switched on and off, MoE with a routed-expert
    width different from the dense one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dist.families import num_experts
    from hf_dist.planner.catalogue import model_spec

    default = AutoConfig.for_model(model_type)
    if attention_bias and not hasattr(default, "attention_bias"):
        pytest.skip(f"{model_type}'s config has no attention_bias")
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128,
                                  tie_word_embeddings=False, **({"attention_bias": attention_bias}
                                                               if hasattr(default, "attention_bias") else {}))
    if num_experts(config):
        for name in ("num_experts", "num_local_experts"):
            if hasattr(config, name):
                setattr(config, name, 4)
        config.num_experts_per_tok, config.moe_intermediate_size = 2, 40
        if not hasattr(default, "moe_intermediate_size"):
            config.intermediate_size = 40  # the experts' width is intermediate_size here
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = model_spec(config)
    assert spec.decoder_layer_classes == (type(model.model.layers[0]).__name__,)
    built = sorted(p.numel() for p in model.model.layers[0].parameters())
    assert sorted(math.prod(shape) for _, shape in spec.layer_param_shapes()) == built
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_the_planner_refuses_a_type_its_registry_does_not_describe_with_the_list_it_does(tmp_path):
    from transformers import AutoConfig

    from hf_dist.families import types_with
    from hf_dist.planner.catalogue import model_spec

    AutoConfig.for_model("olmo2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type='olmo2' .* is not modelled by the planner; supported: "
                                         + ", ".join(types_with("planner"))):
        model_spec(str(tmp_path))

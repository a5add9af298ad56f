"""Guarded internals: every private Trainer method DistTrainer overrides is listed in ``hf_dist.internals``,
still exists with the same parameters, is still called by the Trainer method the list names, and is called in a
real run (FSDP2 owned by hf_dist on one gloo rank: accumulation, clipping, eval, best model, save, resume)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import pytest
from transformers import Trainer

from dist_utils import run_distributed
from hf_dist import internals
from hf_dist.trainer.trainer import DistTrainer

OVERRIDES = {m.name: m for m in internals.overrides()}


def test_every_private_override_is_listed():
    overridden = {
        name for name, value in vars(DistTrainer).items()
        if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(Trainer, name)
    }
    assert overridden == set(OVERRIDES)


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_override_matches_the_trainer_signature(name):
    ours = list(inspect.signature(getattr(DistTrainer, name)).parameters)
    theirs = list(inspect.signature(getattr(Trainer, name)).parameters)
    assert ours == theirs, f"Trainer.{name}{theirs} vs DistTrainer.{name}{ours}"


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_override_is_called_where_listed(name):
    caller = getattr(Trainer, OVERRIDES[name].called_by)
    tree = ast.parse(textwrap.dedent(inspect.getsource(caller)))
    calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"}
    assert name in calls, f"Trainer.{OVERRIDES[name].called_by} no longer uses self.{name}"


def test_a_missing_member_stops_with_the_versions(monkeypatch):
    internals.check_internals()
    monkeypatch.delattr(Trainer, "_clip_grad_norm")
    with pytest.raises(RuntimeError, match=r"transformers.Trainer._clip_grad_norm.*transformers>=5.23,<5.25"):
        internals.check_internals()


def test_trls_private_members_are_there_and_guarded(monkeypatch):
    """The TRL members DistGRPOTrainer overrides or patches exist in the installed trl; one gone stops the check
    DistGRPOTrainer runs first."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert internals.missing_members(internals.TRL_MEMBERS) == []
    monkeypatch.delattr(GRPOTrainer, "_generate")
    with pytest.raises(RuntimeError, match=r"GRPOTrainer._generate\b"):
        internals.check_internals(internals.TRL_MEMBERS)


def test_the_loader_and_apply_layout_stop_first_too(monkeypatch, tmp_path):
    """``hf_dist.from_pretrained`` and ``hf_dist.apply_layout`` run the guard before reading anything they are given
    (here: a folder that does not exist, no arguments, no mesh), not only ``DistTrainer``."""
    import hf_dist

    monkeypatch.delattr(Trainer, "_clip_grad_norm")
    with pytest.raises(RuntimeError, match=r"transformers.Trainer._clip_grad_norm"):
        hf_dist.from_pretrained(str(tmp_path / "missing"), None)
    with pytest.raises(RuntimeError, match=r"transformers.Trainer._clip_grad_norm"):
        hf_dist.apply_layout(None, None, None)


def test_versions_outside_the_tested_range_warn_once_on_the_main_process(monkeypatch, caplog):
    tested = {"transformers": "5.24.0", "accelerate": "1.15.0", "torch": "2.13.0+cpu", "peft": "0.21.2"}
    assert internals.untested_versions(tested) == {}
    newer = {**tested, "transformers": "5.25.0", "trl": "1.17.1"}
    assert internals.untested_versions(newer) == {"transformers": "5.25.0", "trl": "1.17.1"}
    monkeypatch.setattr(internals, "_warned", False)
    monkeypatch.setenv("RANK", "1")
    assert internals.warn_untested_versions(newer) is None  # not the main process
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level("WARNING", logger=internals.__name__):
        message = internals.warn_untested_versions(newer)
        assert internals.warn_untested_versions(newer) is None  # once
    assert message and "transformers 5.25.0 (tested >=5.23,<5.25)" in message and "trl 1.17.1 (tested >=1.16,<1.17)" in message
    assert [r.getMessage() for r in caplog.records] == [message]
    monkeypatch.setattr(internals, "_warned", False)
    monkeypatch.setattr(internals, "installed_versions", lambda: newer)
    with caplog.at_level("WARNING", logger=internals.__name__):
        internals.check_internals()  # the private members are there: no error, the warning
    assert "transformers 5.25.0" in caplog.records[-1].getMessage()


def test_setup_cfg_and_readme_declare_the_tested_ranges():
    """transformers and accelerate: install_requires is the tested range; torch, peft, trl: floored no higher than
    the tested range (no ceiling: pip would downgrade a newer install), the guard warns above it."""
    import configparser
    from pathlib import Path

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[1]
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    lines = [*cfg["options"]["install_requires"].split("\n"), *cfg["options.extras_require"]["dev"].split("\n")]
    declared = {r.name: r.specifier for r in map(Requirement, filter(None, map(str.strip, lines)))}
    readme = (root / "README.md").read_text()
    for package, (low, high) in internals.TESTED_VERSIONS.items():
        assert f"{package}{low},{high}" in readme, package
        if package in ("transformers", "accelerate"):
            assert str(declared[package]) == f"{high},{low}" or set(map(str, declared[package])) == {low, high}
        else:
            assert declared[package].contains(low.lstrip(">="), prereleases=True), package


def _recording_trainer(calls: list[str]):
    def wrap(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return getattr(DistTrainer, name)(self, *args, **kwargs)
        return method

    return type("RecordingTrainer", (DistTrainer,), {name: wrap(name) for name in OVERRIDES})


def _one_rank_run(rank, world_size, output_dir):
    from hf_dist import DistTrainingArguments
    from pp_harness import PaddedDataset, tiny_model

    calls: list[str] = []
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        max_grad_norm=0.5, learning_rate=1e-3, save_strategy="steps", save_steps=2, eval_strategy="steps",
        eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss", report_to=[],
        disable_tqdm=True, fsdp="full_shard", fsdp_config={"version": 2},
    )
    data = dict(train_dataset=PaddedDataset(32, seed=1), eval_dataset=PaddedDataset(4, seed=2))
    trainer = _recording_trainer(calls)(model=tiny_model(), args=DistTrainingArguments(**common), **data)
    trainer.train()
    trainer.save_model(f"{output_dir}/final")
    resumed = _recording_trainer(calls)(model=tiny_model(), args=DistTrainingArguments(**common), **data)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-2")
    return sorted(set(calls))


def test_every_override_is_called_in_a_real_run(tmp_path):
    (called,) = run_distributed(_one_rank_run, 1, str(tmp_path))
    assert called == sorted(OVERRIDES)


_STDLIB_PRIVATES = {"_action_groups", "_group_actions"}
"""argparse's, read by configs.strict to list a parser's options by group (the standard library, not a package whose
version range hf_dist declares)."""


def _private_names_touched() -> dict[str, set[str]]:
    """``{name: files}`` of the private names hf_dist reads or calls on objects it does not own -- attributes, getattr
    strings, and names or modules imported from torch / transformers / accelerate / peft / trl -- leaving out the
    attribute names hf_dist defines or assigns itself anywhere (a library member of the same name as one of
    hf_dist's, ``nn.Module._apply`` beside the styles' ``_apply``, is listed by hand)."""
    import pathlib

    import hf_dist

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    own, touched = set(), {}
    trees = {path: ast.parse(path.read_text()) for path in pathlib.Path(hf_dist.__file__).parent.rglob("*.py")}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                own.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "setattr", "__setattr__") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                own.add(node.args[1].value)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names, imported = [], False
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    names = [node.attr]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names = [node.args[1].value]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                    "torch", "transformers", "accelerate", "peft", "trl"):
                names, imported = [a.name for a in node.names], True  # the library's, whatever hf_dist names
                if any(private(part) for part in node.module.split(".")):
                    names.append(node.module)
            for name in names:
                if isinstance(name, str) and (private(name) or "._" in name) and (imported or name not in own):
                    touched.setdefault(name, set()).add(path.name)
    return touched


def test_every_private_library_member_hf_dist_touches_is_registered():
    """Not only the Trainer's: a private torch / transformers / accelerate / trl member read anywhere in hf_dist is
    listed in the registry (so the start-up guard checks it), or is the standard library's."""
    members = (*internals.PRIVATE_MEMBERS, *internals.TRL_MEMBERS)
    registered = {m.name for m in members} | {m.owner for m in members}
    touched = _private_names_touched()
    assert {"_flatten", "_global_mapping", "_execution_engine", "_world", "_local_tensor"} <= set(touched)
    unlisted = {name: sorted(files) for name, files in touched.items()
                if name not in registered and name not in _STDLIB_PRIVATES}
    assert unlisted == {}


@pytest.mark.parametrize(("owner", "name"), [
    ("torch.distributed.device_mesh.DeviceMesh", "_flatten"),
    ("transformers.masking_utils.AttentionMaskInterface", "_global_mapping"),
    ("torch.autograd.Variable", "_execution_engine"),
    ("torch.distributed.distributed_c10d", "_world"),
])
def test_a_missing_member_outside_the_trainer_stops_with_the_versions(monkeypatch, owner, name):
    assert internals.missing_members() == []
    found = internals._resolve(owner)
    for holder in getattr(found, "__mro__", (found,)):  # gone from the class and the bases that define it
        if name in vars(holder):
            monkeypatch.delattr(holder, name)
    with pytest.raises(RuntimeError, match=rf"{re.escape(owner)}\.{name}, which .*torch .*no longer have"):
        internals.check_internals()


def test_a_member_declared_on_the_class_counts_and_a_vanished_module_is_missing(monkeypatch):
    """Instance attributes are found by the class's declaration (``nn.Module._parameters``); a private module that
    is gone is reported, an optional package that is not installed is not."""
    from torch import nn

    assert not hasattr(nn.Module, "_parameters") and internals.missing_members() == []
    members = (internals.PrivateMember(owner="torch.distributed._no_such_module", name="f", kind="call", where="x",
                                       why="y"),
               internals.PrivateMember(owner="not_an_installed_package.thing", name="f", kind="call", where="x",
                                       why="y"))
    assert internals.missing_members(members) == ["torch.distributed._no_such_module.f"]

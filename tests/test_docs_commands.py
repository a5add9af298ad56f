"""The ``hf-dist plan`` commands the docs show (``DOCS``) run as written, and choose what the docs say they choose.

A user copies these lines; each is taken from the Markdown itself (code blocks and inline code), ``$MODEL`` pointed at
a tiny local config folder, and run through the command line's own entry point in this process. Where the docs say
a command "chooses `LAYOUT`", the plan's choice must be that layout.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from hf_dist.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/commands.md", "examples/harbor/README.md", "examples/moe/README.md")


def _plan_commands(text: str) -> list[tuple[str, str | None]]:
    """Every ``hf-dist plan`` command line in ``text`` with the layout the prose says it chooses (None: not said)."""
    found = []
    for match in re.finditer(r"`(hf-dist plan [^`]+)`(?:\s+chooses\s+`([^`]+)`)?", text):  # inline code
        found.append((" ".join(match.group(1).split()), match.group(2)))
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):  # code blocks, one command per line
        for line in block.splitlines():
            if line.strip().startswith("hf-dist plan "):
                found.append((" ".join(shlex.split(line, comments=True)), None))
    return found


def _commands() -> list[tuple[str, str, str | None]]:
    return [(doc, command, chosen) for doc in DOCS for command, chosen in _plan_commands((ROOT / doc).read_text())]


def test_the_docs_show_plan_commands():
    """The parser finds the commands (else the test below would pass on nothing), the README's quick-start one too."""
    commands = [command for _, command, _ in _commands()]
    assert any('--model "$MODEL"' in c for c in commands), commands
    assert any(chosen for _, _, chosen in _commands()), "no 'chooses `LAYOUT`' claim found in docs/commands.md"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """What ``$MODEL`` stands for: a local folder with a small Llama config (SmolLM2's type)."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("model")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(("doc", "command", "chosen"), _commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_plan_command_runs_as_written(doc, command, chosen, tiny_model, capsys):
    argv = shlex.split(command.replace('"$MODEL"', shlex.quote(tiny_model)))
    assert argv[:2] == ["hf-dist", "plan"]
    assert main([*argv[1:], "--json"]) == 0, f"{doc}: `{command}` failed: {capsys.readouterr().err}"
    plan = json.loads(capsys.readouterr().out)
    if chosen is not None:
        assert plan["chosen"] == chosen, f"{doc} says `{command}` chooses {chosen}; it chooses {plan['chosen']}"


def test_plan_without_gpu_on_a_machine_without_one_names_the_flag(monkeypatch, capsys):
    """Leaving ``--gpu`` out plans for this machine's GPU; with none here, the error names ``--gpu`` and the kinds."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--model", "llama-2-13b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "--gpu" in err and "a100-80gb" in err


def test_plan_without_gpu_uses_this_machines_kind(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert main(["plan", "--model", "llama-2-13b", "--gpus", "8", "--json"]) == 0
    captured = capsys.readouterr()
    assert "--gpu a100-80gb (this machine's GPU)" in captured.err
    assert json.loads(captured.out)["gpu"]["name"] == "a100-80gb"

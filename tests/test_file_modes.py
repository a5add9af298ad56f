"""Saved weights get the user's umask (0644 under umask 022), not safetensors' private 0600 (pure, one process).

safetensors' ``save_file`` writes through a temporary file and renames it, leaving mode 0600: a model saved for a
team (or a shared model cache) could not be read by anyone else. hf_dist's writers and ``DistTrainer``'s saves
give those files the mode ``open()`` would have.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from hf_dist import DistTrainer, DistTrainingArguments
from hf_dist.file_modes import save_safetensors
from hf_dist.models import build_tiny_model
from hf_dist.state_dict import save_streaming


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_safetensors_alone_leaves_0600(tmp_path, umask):
    """The reason for all this: if safetensors ever follows the umask itself, the helpers can go."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "raw.safetensors"))
    assert _mode(tmp_path / "raw.safetensors") == 0o600
    save_safetensors({"a": torch.zeros(2)}, tmp_path / "ours.safetensors")
    assert _mode(tmp_path / "ours.safetensors") == 0o666 & ~umask


def test_streamed_save_follows_the_umask(tmp_path, umask):
    model = build_tiny_model(vocab_size=128, hidden_size=32, num_hidden_layers=1)
    save_streaming(model, str(tmp_path / "final"))
    assert _mode(tmp_path / "final" / "model.safetensors") == 0o666 & ~umask
    assert _mode(tmp_path / "final" / "config.json") == 0o666 & ~umask


def test_trainer_save_model_follows_the_umask(tmp_path, umask):
    """A layout hf_dist does not own (one process) saves through the Trainer's own save_pretrained."""
    model = build_tiny_model(vocab_size=128, hidden_size=32, num_hidden_layers=1)
    args = DistTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    DistTrainer(model=model, args=args).save_model(str(tmp_path / "final"))
    assert _mode(tmp_path / "final" / "model.safetensors") == 0o666 & ~umask

"""The shipped DeepSpeed YAMLs work from any working directory (pure: the launcher's own environment, no process).

accelerate opens ``deepspeed_config_file`` (``ds_configs/zero3.json`` in the shipped YAMLs) relative to each
launched process's working directory; from anywhere but the repository root it failed with a ``UnicodeDecodeError``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from dist_utils import launcher_env
from hf_dist import DistTrainingArguments
from hf_dist.trainer.launch_env import DEEPSPEED_FILE_ENV

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_")) or key == "WORLD_SIZE":
            monkeypatch.delenv(key)


@pytest.mark.parametrize("name, stage", [("zero3.yaml", 3), ("zero2.yaml", 2)])
def test_shipped_deepspeed_yaml_from_another_directory(tmp_path, monkeypatch, name, stage):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.chdir(tmp_path)  # a user's run folder: no ds_configs/ here
    _, env = launcher_env(ROOT / "accelerate_configs" / name)
    assert not Path(env[DEEPSPEED_FILE_ENV]).is_absolute()  # what accelerate hands each process
    with mock.patch.dict(os.environ, env):
        args = DistTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[])
        assert os.environ[DEEPSPEED_FILE_ENV] == str(ROOT / env[DEEPSPEED_FILE_ENV])
        assert args.deepspeed_plugin.zero_stage == stage
        assert DeepSpeedPlugin().zero_stage == stage  # a later reader (the Accelerator's) finds it too


def test_a_path_found_from_the_working_directory_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds_configs").mkdir()
    own = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    (tmp_path / "ds_configs" / "zero3.json").write_text(json.dumps(own))  # the user's own file of that name
    _, env = launcher_env(ROOT / "accelerate_configs" / "zero3.yaml")
    with mock.patch.dict(os.environ, env):
        args = DistTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[])
        assert os.environ[DEEPSPEED_FILE_ENV] == "ds_configs/zero3.json"
        assert args.deepspeed_plugin.zero_stage == 2


def test_deepspeed_argument_is_resolved_the_same_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = DistTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], deepspeed="ds_configs/zero2.json")
    assert args.deepspeed == str(ROOT / "ds_configs" / "zero2.json")


def test_a_missing_json_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with mock.patch.dict(os.environ, {"ACCELERATE_USE_DEEPSPEED": "true", DEEPSPEED_FILE_ENV: "ds_configs/nope.json"}):
        with pytest.raises(ValueError, match=rf"{DEEPSPEED_FILE_ENV}=ds_configs/nope.json .* names the DeepSpeed "
                                             r"config 'ds_configs/nope.json', which is not a file .*use an absolute"):
            DistTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[])
    with pytest.raises(ValueError, match=r"--deepspeed /no/such.json names the DeepSpeed config"):
        DistTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], deepspeed="/no/such.json")

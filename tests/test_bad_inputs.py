"""Bad input is a ValueError naming the value, the rule and the fix, before any process group (pure).

One test per case found by trying invalid inputs as a user would (issue 14): the learning rate, the device peak,
pipeline micro-batches, DeepSpeed with TP/PP, and the Harbor recipe's data flags.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from hf_dist import DistTrainingArguments
from hf_dist.batch import BatchContract
from hf_dist.cli import main as cli_main
from tests.dist_utils import load_recipe



@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")) or key == "WORLD_SIZE":
            monkeypatch.delenv(key)


def _args(tmp_path, **kw):
    return DistTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_learning_rate_and_base_learning_rate_together(tmp_path):
    for lr in (5e-5, 1e-4):  # 5e-5 is the Trainer's default: given explicitly, it is still a contradiction
        with pytest.raises(ValueError, match=rf"learning_rate={lr:g} and base_learning_rate=2e-05 were both given.*"
                                             r"pass only one of them"):
            _args(tmp_path, learning_rate=lr, base_learning_rate=2e-5, base_batch_size=4, global_batch_size=8,
                  per_device_train_batch_size=2)
    args = _args(tmp_path, base_learning_rate=2e-5, base_batch_size=4, global_batch_size=8,
                 per_device_train_batch_size=2)
    assert args.learning_rate == pytest.approx(4e-5)
    assert _args(tmp_path).learning_rate == 5e-5  # unset and no base: the Trainer's default
    again = DistTrainingArguments(**{k: v for k, v in args.to_dict().items() if k in ("output_dir", "learning_rate",
                                     "base_learning_rate", "base_batch_size", "global_batch_size",
                                     "per_device_train_batch_size", "use_cpu")}, report_to=[])
    assert again.learning_rate == pytest.approx(4e-5)  # re-created from its own values: the derived LR is accepted


@pytest.mark.parametrize("base_lr", [-1.0, 0.0, math.nan, math.inf])
def test_base_learning_rate_must_be_positive_and_finite(tmp_path, base_lr):
    with pytest.raises(ValueError, match=rf"base_learning_rate={base_lr!r} must be a positive finite number"):
        BatchContract(world_size=1, global_batch_size=8, micro_batch_size=2, base_learning_rate=base_lr,
                      base_batch_size=8, lr_scaling="linear")
    with pytest.raises(ValueError, match="base_learning_rate=.* must be a positive finite number"):
        _args(tmp_path, base_learning_rate=base_lr, base_batch_size=8, global_batch_size=8)


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_cli_batch_refuses_bad_base_lr(capsys, value):
    code = cli_main(["batch", "--world-size", "2", "--global-batch", "32", "--micro-batch", "2", "--base-lr", value,
                     "--base-batch", "32"])
    assert code == 2
    assert "base_learning_rate=" in capsys.readouterr().err


def test_negative_learning_rate(tmp_path):
    with pytest.raises(ValueError, match=r"learning_rate=-0.1 must be a finite non-negative number"):
        _args(tmp_path, learning_rate=-0.1)


@pytest.mark.parametrize("peak", [-1.0, 0.0, math.nan])
def test_peak_tflops_must_be_positive(tmp_path, peak):
    with pytest.raises(ValueError, match=rf"peak_tflops={peak!r} must be a positive number of TFLOP/s.*leave it unset"):
        _args(tmp_path, peak_tflops=peak)


def test_pp_microbatches_zero_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"pp_microbatches=0 must be a positive integer"):
        _args(tmp_path, pp_microbatches=0)


@pytest.mark.parametrize("sizes", [dict(tp_size=2), dict(pp_size=2)])
def test_deepspeed_with_tp_or_pp_is_refused(tmp_path, monkeypatch, sizes):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` with zero2.yaml sets
    with pytest.raises(ValueError, match=r"DeepSpeed zero2 with .* does not compose with hf_dist's TP/PP; use FSDP2 "
                                         r"\(accelerate_configs/fsdp.yaml\)"):
        _args(tmp_path, **sizes)


def test_recipe_data_path_needs_a_model(tmp_path):
    with pytest.raises(ValueError, match=r"--data_path .*x.jsonl needs --model_name_or_path"):
        load_recipe().parse(["--data_path", str(tmp_path / "x.jsonl"), "--output_dir", str(tmp_path)])


def test_recipe_output_dir_must_be_a_folder(tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("keep me")
    with pytest.raises(ValueError, match=r"--output_dir .*notes.txt is an existing file, not a folder.*choose another"):
        load_recipe().parse(["--output_dir", str(taken)])
    with pytest.raises(ValueError, match=r"--output_dir .*notes.txt/run lies under .*notes.txt, which is a file"):
        load_recipe().parse(["--output_dir", str(taken / "run")])
    assert taken.read_text() == "keep me"


@pytest.mark.parametrize("flag", ["--save_steps", "--eval_steps"])
def test_recipe_steps_flag_alone_implies_the_steps_strategy(tmp_path, flag):
    """The presets say --save_strategy no (tiny: --eval_strategy no too); an interval given alone is obeyed."""
    _, args = load_recipe().parse(["--output_dir", str(tmp_path), f"{flag}=3"])
    strategy = args.save_strategy if flag == "--save_steps" else args.eval_strategy
    assert (strategy.value, getattr(args, flag[2:])) == ("steps", 3)
    _, preset_only = load_recipe().parse(["--output_dir", str(tmp_path)])
    assert (preset_only.save_strategy.value, preset_only.eval_strategy.value) == ("no", "no")


def test_recipe_steps_flag_against_another_strategy_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--save_steps 1 with --save_strategy no: --save_steps is used only with "
                                         r"--save_strategy steps; drop --save_strategy"):
        load_recipe().parse(["--output_dir", str(tmp_path), "--save_steps", "1", "--save_strategy", "no"])
    _, args = load_recipe().parse(["--output_dir", str(tmp_path), "--save_steps", "1", "--save_strategy", "steps"])
    assert args.save_strategy.value == "steps"


def test_recipe_missing_resume_path_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    recipe = load_recipe()
    monkeypatch.setattr(recipe, "build_model", lambda *a: pytest.fail("the model loaded before the check"))
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(ValueError, match=rf"^Can't find a valid checkpoint at {missing}: no such file or folder; "
                                         r"pass a checkpoint-N folder"):
        recipe.main(["--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(missing)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.* nor a folder holding a complete one"):
        recipe.parse(["--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(tmp_path / "empty")])
    assert not (tmp_path / "run").exists()  # nothing written either


def test_recipe_show_answers_with_pipeline_parallelism_is_refused():
    from types import SimpleNamespace

    recipe = load_recipe()  # parse() calls this check; pp_size=2 arguments need 2 launched ranks, so it is called alone
    with pytest.raises(ValueError, match=r"--show_answers 2 with --pp_size 2: a pipeline-parallel model .* drop "
                                         r"--show_answers"):
        recipe.check_show_answers(recipe.ScriptArguments(show_answers=2), SimpleNamespace(pp_size=2))
    recipe.check_show_answers(recipe.ScriptArguments(show_answers=2), SimpleNamespace(pp_size=1))


def test_greedy_answer_refuses_a_model_without_generate():
    import torch

    from hf_dist.models import greedy_answer

    with pytest.raises(ValueError, match=r"Linear has no generate\(\): a pipeline-parallel model"):
        greedy_answer(torch.nn.Linear(2, 2), tokenizer=None, messages="hello")

# -- hf-dist config / plan ----------------------------------------------------------------------------------
CONFIG = ["config", "--strategy", "zero2", "--gpus", "2", "--micro-batch", "1", "--global-batch", "8"]
PLAN = ["plan", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", "512", "--global-batch", "64"]


def test_config_out_existing_files_are_refused(tmp_path, capsys):
    out = tmp_path / "cfg"
    assert cli_main([*CONFIG, "--out", str(out)]) == 0
    (out / "deepspeed.json").write_text("{\"edited\": true}")
    assert cli_main([*CONFIG, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds deepspeed.json" in err and "--overwrite" in err
    assert (out / "deepspeed.json").read_text() == "{\"edited\": true}"  # nothing written
    assert cli_main([*CONFIG, "--out", str(out), "--overwrite"]) == 0
    assert "edited" not in (out / "deepspeed.json").read_text()


def test_config_check_names_the_malformed_file(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text("{bad")
    assert cli_main(["config", "--check", str(bad)]) == 2
    assert f"error: {bad}: " in capsys.readouterr().err


def test_nvme_offload_needs_zero3(tmp_path, capsys):
    for strategy in ("zero1", "zero2"):
        args = ["config", "--strategy", strategy, "--gpus", "2", "--micro-batch", "1", "--global-batch", "8",
                "--offload", "nvme", "--out", str(tmp_path / strategy)]
        assert cli_main(args) == 2
        assert f"offload='nvme' with strategy='{strategy}'" in capsys.readouterr().err
        assert not (tmp_path / strategy).exists()


def _config_dir(path: Path) -> Path:
    from hf_dist.models import tiny_llama_config

    tiny_llama_config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2).save_pretrained(str(path))
    return path


def test_plan_model_inputs(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": ')
    assert cli_main([*PLAN, "--model", str(broken)]) == 2
    assert f"{broken / 'config.json'} cannot be read as a model config" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main([*PLAN, "--model", str(empty)]) == 2
    assert f"model='{empty}' is a folder without config.json" in capsys.readouterr().err
    model = _config_dir(tmp_path / "tiny")
    assert cli_main([*PLAN, "--model", str(model / "config.json")]) in (0, 1)  # the file is accepted: it plans
    assert "chosen" in capsys.readouterr().out


def test_plan_output_paths_are_checked_before_planning(tmp_path, capsys):
    assert cli_main([*PLAN, "--model", "llama-2-13b", "--plot", str(tmp_path / "no" / "x.png")]) == 2
    assert f"folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    out = tmp_path / "out"
    out.mkdir()
    (out / "launch.sh").write_text("mine")
    assert cli_main([*PLAN, "--model", "llama-2-13b", "--out", str(out)]) == 2
    assert f"--out {out} is not empty" in capsys.readouterr().err
    assert (out / "launch.sh").read_text() == "mine"


@pytest.mark.parametrize("name", ["per_device_train_batch_size", "per_device_eval_batch_size"])
def test_batch_sizes_must_be_positive(tmp_path, name):
    with pytest.raises(ValueError, match=rf"{name}=0 must be a positive integer"):
        _args(tmp_path, **{name: 0})


def test_fp16_on_a_machine_without_gpu_warns_and_the_recipe_refuses(tmp_path, monkeypatch, caplog):
    from hf_dist.trainer import launch_env

    monkeypatch.setattr(launch_env, "has_gpu", lambda: False)
    with caplog.at_level("WARNING", logger="hf_dist.trainer.args"):
        _args(tmp_path, fp16=True)  # the Trainer accepts it (drop-in): said once, not silently run in fp32
    assert "fp16=True on a machine without a GPU" in caplog.text and "use --bf16 true" in caplog.text
    with pytest.raises(ValueError, match=r"fp16=True on a machine without a GPU.*would train in fp32"):
        load_recipe().parse(["--fp16", "true", "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_hsdp_request_that_does_not_fill_the_world_is_refused(tmp_path, monkeypatch):
    # an accelerate HSDP YAML asking 2 replicas x 2 shards, launched on 2 processes
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    with pytest.raises(ValueError, match=r"dp_replicate=2 x dp_shard=2 = 4 but the launch has 2 data-parallel ranks.*"
                                         r"would silently run as 2 x 1; launch 4 processes"):
        _args(tmp_path)


@pytest.mark.parametrize("axis, match", [
    ("CP", r"cp_size=2 does not divide the world size 1"),  # honoured as cp_size (tests/test_context_parallel.py)
    ("SP", r"parallelism_config_sp_size=2 .*which hf_dist does not run.*use parallelism_config_cp_size"),
])
def test_context_or_sequence_parallel_request_is_never_dropped(tmp_path, monkeypatch, axis, match):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv(f"PARALLELISM_CONFIG_{axis}_SIZE", "2")
    with pytest.raises(ValueError, match=match):
        _args(tmp_path)


def test_label_smoothing_with_pipeline_is_refused_not_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # a layout that fits; refused for the smoothing alone
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0.1 with pp_size=2: .*would be ignored; drop "
                                         r"label_smoothing_factor or set pp_size=1"):
        _args(tmp_path, pp_size=2, label_smoothing_factor=0.1)

"""examples/harbor/train.py trains from data as users bring it: a plain-text file and a prompt/completion file.

One process, in this process (the recipe's ``main``), a tiny model saved like a Hub checkpoint, a few steps.
"""

import json
from pathlib import Path

import pytest

from tests.dist_utils import load_recipe

COMMON = [
    "--preset", "tiny", "--max_seq_len", "48", "--per_device_train_batch_size", "4", "--global_batch_size", "4",
    "--max_steps", "4", "--logging_steps", "1", "--warmup_steps", "0", "--lr_scheduler_type", "constant",
    "--base_learning_rate", "3e-3", "--base_batch_size", "4", "--eval_fraction", "0.2", "--use_cpu", "true",
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from hf_dist import data
    from hf_dist.models import build_tiny_model, tiny_llama_config

    out = tmp_path_factory.mktemp("tiny")
    _, tok = data.prepare_demo_data(out / "data", n=80, seed=0, vocab_size=400)
    config = tiny_llama_config(vocab_size=len(tok), hidden_size=48, num_hidden_layers=2, **data.special_token_ids(tok))
    build_tiny_model(config, seed=1).save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    return out / "model"


def _train(tiny_model_dir: Path, data_path: Path, out: Path, *more: str) -> dict:
    assert load_recipe().main([*COMMON, "--model_name_or_path", str(tiny_model_dir), "--data_path", str(data_path),
                           "--output_dir", str(out), *more]) == 0
    return json.loads((out / "summary.json").read_text())


def test_trains_from_a_plain_text_file(tiny_model_dir, tmp_path):
    from hf_dist.data import generate_conversations

    lines = [m["content"] for c in generate_conversations(60, seed=2) for m in c["messages"] if m["role"] != "system"]
    (tmp_path / "notes.txt").write_text("\n".join(lines) + "\n")
    summary = _train(tiny_model_dir, tmp_path / "notes.txt", tmp_path / "run")
    assert len(summary["losses"]) == 4
    assert summary["perplexity_after"] < 0.9 * summary["perplexity_before"], summary


def test_trains_from_a_prompt_completion_file(tiny_model_dir, tmp_path):
    from hf_dist.data import generate_conversations

    turns = [[m["content"] for m in c["messages"] if m["role"] != "system"] for c in generate_conversations(60, seed=3)]
    rows = [{"prompt": t[0], "completion": t[1]} for t in turns]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _train(tiny_model_dir, tmp_path / "pairs.jsonl", tmp_path / "run", "--show_answers", "2",
                     "--answer_tokens", "4")
    assert len(summary["losses"]) == 4
    assert summary["perplexity_after"] < 0.9 * summary["perplexity_before"], summary
    # --show_answers answers the file's own held-out prompts (the eval split's, as plain text), not Harbor's
    from hf_dist.data import held_out_prompts

    assert summary["prompts"] == held_out_prompts(tmp_path / "pairs.jsonl", 2, eval_fraction=0.2, seed=0)
    assert len(summary["prompts"]) == 2 and all(p in {r["prompt"] for r in rows} for p in summary["prompts"])
    assert len(summary["answers_after"]) == 2 and summary["reload_same_answers"], summary


def test_data_without_a_model_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="--data_path .* needs --model_name_or_path"):
        load_recipe().main(["--data_path", str(tmp_path / "x.txt"), "--output_dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_save_steps_alone_saves_and_files_are_readable_by_others(tiny_model_dir, tmp_path):
    """--save_steps 2 without --save_strategy (the preset says no) writes checkpoints; weights get the umask's mode."""
    import os
    import stat

    from hf_dist.data import write_jsonl

    previous = os.umask(0o022)
    try:
        assert load_recipe().main([*COMMON, "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                                   str(tmp_path / "run"), "--data_path", str(write_jsonl(tmp_path / "t.jsonl", 40)),
                                   "--save_steps", "2"]) == 0
    finally:
        os.umask(previous)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    for folder in ("final", "checkpoint-4"):
        path = tmp_path / "run" / folder / "model.safetensors"
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path

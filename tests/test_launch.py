"""End to end: `accelerate launch` with the shipped configs runs examples/harbor/train.py on 2 CPU processes.

Each layout's run of 5 optimizer steps equals a single-process run with the same global batch through
``parity.assert_parity`` (fp32): the logged losses and gradient norms, and every weight of the model it saved
(``launch_harness.launched_run``); and the run reports the layout it asked for (FSDP2 is really sharded, DeepSpeed
really runs ZeRO). LoRA under FSDP2 with ``--show_answers`` trains, saves the same adapter and answers as one process.
The last two tests check the launch itself (a non-Llama model under the shipped FSDP2 YAML, the ZeRO-3 YAML from
another folder), not numbers: they have no one-process run to compare with and add none (a launch each).
These are the expensive tests: one launch per layout, tiny model, short sequences.
"""

import math

import pytest

from launch_harness import COMMON, launch, launched_run, one_process
from parity import assert_parity

LAYOUTS = {
    "ddp": "DDP (MULTI_CPU)",
    "fsdp": "FSDP2 FULL_SHARD (hf_dist fully_shard)",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    one_process(out)
    return launched_run(out)


@pytest.mark.parametrize("config", list(LAYOUTS))
def test_layout_matches_single_process(reference, config, tmp_path):
    summary = launch(config, tmp_path)
    assert summary["layout"].endswith(LAYOUTS[config]), summary["layout"]  # no silent fallback
    run = launched_run(tmp_path)
    assert len(run["losses"]) == 5
    assert_parity(run, reference, what=config)
    assert summary["reload"].startswith("AutoModelForCausalLM.from_pretrained: ok")


def test_lora_under_fsdp2_saves_a_real_adapter_and_answers_as_one_process(tmp_path):
    lora = ["--lora", "--lora_r", "4", "--show_answers", "2", "--answer_tokens", "6"]
    one = one_process(tmp_path / "single", *lora)
    summary = launch("fsdp", tmp_path, *lora)  # generate() of a PeftModel under FSDP2 once met sharded embeddings
    assert summary["reload"].startswith("AutoPeftModelForCausalLM.from_pretrained: ok")
    assert_parity(launched_run(tmp_path), launched_run(tmp_path / "single"), what="LoRA")  # adapters
    for when in ("answers_before", "answers_after", "answers_reloaded"):
        assert len(summary[when]) == 2 and summary[when] == one[when], when
    assert summary["reload_same_answers"]
    adapter = launched_run(tmp_path)["state"]
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.numel() > 0 for t in adapter.values())
    assert any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: nonzero means it trained and was gathered


def test_shipped_fsdp_yaml_trains_a_non_llama_model(tmp_path):
    """fsdp.yaml names no wrap class: a Qwen2 model is sharded by its own Qwen2DecoderLayer (it once stopped)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_dist import data

    jsonl, tok = data.prepare_demo_data(tmp_path / "data", n=160, seed=0, vocab_size=400)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, **data.special_token_ids(tok))
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen2")
    tok.save_pretrained(tmp_path / "qwen2")
    summary = launch("fsdp", tmp_path / "run", "--model_name_or_path", str(tmp_path / "qwen2"),
                     "--data_path", str(jsonl), "--max_steps", "2")
    assert summary["layout"].endswith(LAYOUTS["fsdp"]), summary["layout"]
    assert len(summary["losses"]) == 2 and all(math.isfinite(loss) for loss in summary["losses"])


def test_shipped_zero3_yaml_from_another_directory(tmp_path):
    """Launched from a user's folder (no ds_configs/ there), zero3.yaml still finds its DeepSpeed JSON."""
    (tmp_path / "elsewhere").mkdir()
    summary = launch("zero3", tmp_path / "run", "--max_steps", "2", cwd=tmp_path / "elsewhere")
    assert summary["layout"].endswith(LAYOUTS["zero3"]), summary["layout"]
    assert len(summary["losses"]) == 2

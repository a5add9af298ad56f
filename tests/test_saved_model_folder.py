"""A model saved into a folder that holds an earlier save never reloads mixed with it (issue 27.9).

The Harbor recipe saves into ``<output_dir>/final`` with ``DistTrainer.save_model``: a LoRA run and then a full run
into the same ``--output_dir`` left the adapter there, and transformers' ``from_pretrained`` of the folder then
loaded the adapter on its base instead of the full model saved. The earlier save's model files now move into
``final/previous_run-<time>/`` (the move that keeps an earlier run's checkpoints), byte for byte. One process, no
training: what matters is the folder.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

ADAPTER = {"adapter_config.json", "adapter_model.safetensors"}
FULL = {"config.json", "generation_config.json", "model.safetensors"}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from hf_dist.models import build_tiny_model, tiny_llama_config

    directory = tmp_path_factory.mktemp("base")
    build_tiny_model(tiny_llama_config(vocab_size=64, hidden_size=16, num_hidden_layers=1), seed=0).save_pretrained(
        directory)
    return directory


def _save(model, folder, tmp_path) -> None:
    from hf_dist import DistTrainer, DistTrainingArguments

    args = DistTrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    DistTrainer(model=model, args=args).save_model(str(folder))


def _full(base_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():  # trained weights: not the base's
        for p in model.parameters():
            p.add_(0.5)
    return model


def _lora(base_dir):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hf_dist.models import add_adapters

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    lora = add_adapters(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"), seed=0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.fill_(0.25)  # a trained adapter changes the output
    return lora


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _names(folder) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def _aside(folder):
    (aside,) = folder.glob("previous_run-*")
    return aside


def test_full_model_saved_over_an_adapter_reloads_as_itself(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    final = tmp_path / "final"
    _save(_lora(base_dir), final, tmp_path)
    adapter_files = _files(final)
    assert ADAPTER <= set(adapter_files)
    full = _full(base_dir)
    _save(full, final, tmp_path)
    assert not ADAPTER & _names(final)
    assert _files(_aside(final)).items() >= {k: adapter_files[k] for k in ADAPTER}.items()  # kept, byte for byte
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    names = [n for n, _ in reloaded.named_parameters()]
    assert not [n for n in names if "lora_" in n]  # not the old adapter on its base
    expected = full.state_dict()
    for name, value in reloaded.state_dict().items():
        assert_close(value, expected[name], atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def test_adapter_saved_over_a_full_model_reloads_as_the_adapter_on_its_base(base_dir, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    final = tmp_path / "final"
    _save(_full(base_dir), final, tmp_path)
    full_files = _files(final)
    assert FULL <= set(full_files)
    lora = _lora(base_dir)
    _save(lora, final, tmp_path)
    assert not FULL & _names(final)
    assert _files(_aside(final)).items() >= {k: full_files[k] for k in FULL}.items()
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    for reload in (AutoPeftModelForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        model = reload(final)
        got = {n.replace(".base_layer", "").removeprefix("base_model.model."): v
               for n, v in model.state_dict().items()}
        for name, value in base.items():  # the base's weights, not the earlier full model's beside the adapter
            assert_close(got[name], value, atol=0, rtol=0, msg=lambda m: f"{reload.__qualname__} {name}: {m}")
        lora_b = [v for n, v in got.items() if "lora_B" in n]
        assert lora_b and all(bool((v == 0.25).all()) for v in lora_b)


def test_a_folder_without_a_model_is_left_alone(tmp_path):
    from hf_dist.trainer.resume import move_earlier_model

    (tmp_path / "log_history.jsonl").write_text("{}\n")
    assert move_earlier_model(tmp_path) is None and move_earlier_model(tmp_path / "missing") is None
    assert [p.name for p in tmp_path.iterdir()] == ["log_history.jsonl"]

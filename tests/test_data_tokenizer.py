"""The offline chat tokenizer: trains, saves, reloads with AutoTokenizer, renders the chat template."""

import json

import pytest
from transformers import AutoTokenizer

from hf_dist.data import train_tokenizer, train_tokenizer_from_texts, write_jsonl
from hf_dist.data.tokenizer import ROLE_MARKERS, SPECIAL_TOKENS


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    jsonl = write_jsonl(root / "t.jsonl", 300, seed=0)
    tokenizer = train_tokenizer(jsonl, root / "tokenizer", vocab_size=600)
    return jsonl, root / "tokenizer", tokenizer


def test_reloads_with_auto_tokenizer(trained):
    _, directory, tokenizer = trained
    loaded = AutoTokenizer.from_pretrained(str(directory))
    assert len(loaded) == len(tokenizer) == 600
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<|begin|>", "<|end|>", "<|pad|>")
    assert loaded.padding_side == "right"
    assert loaded.chat_template == tokenizer.chat_template
    text = "Refund order #48213 for $12.50, please."
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text


def test_special_tokens_are_single_ids(trained):
    _, directory, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and tokenizer.unk_token_id not in ids
    for marker in ROLE_MARKERS:
        assert tokenizer(f"hi {marker} there", add_special_tokens=False)["input_ids"].count(
            tokenizer.convert_tokens_to_ids(marker)
        ) == 1


def test_chat_template_renders_roles_and_ends_turns_with_eos(trained):
    jsonl, directory, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is my payout?"},
        {"role": "assistant", "content": "It lands tomorrow."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|begin|><|system|>Be brief.<|end|><|user|>Where is my payout?<|end|>"
        "<|assistant|>It lands tomorrow.<|end|>"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|assistant|>")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id


def test_merges_learned_from_the_transcripts(trained):
    jsonl, _, tokenizer = trained
    first = json.loads(jsonl.read_text().splitlines()[0])["messages"][-1]["content"]
    n_tokens = len(tokenizer(first, add_special_tokens=False)["input_ids"])
    assert n_tokens < len(first.encode()) / 2  # BPE merges, not bytes


def test_training_is_deterministic(tmp_path):
    texts = ["refund the chargeback payout", "payout schedule daily", "api key rotated"] * 20
    a = train_tokenizer_from_texts(texts, tmp_path / "a", vocab_size=300)
    b = train_tokenizer_from_texts(texts, tmp_path / "b", vocab_size=300)
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_too_small_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=200 is too small"):
        train_tokenizer_from_texts(["x"], tmp_path / "t", vocab_size=200)

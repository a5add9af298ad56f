"""Transcript datasets: validation errors, assistant-only labels, truncation, splits and the collator."""

import copy
import json
import logging

import pytest
import torch

from hf_dist.data import (
    assistant_token_mask,
    build_datasets,
    data_collator,
    prepare_demo_data,
    read_transcripts,
    tokenize_conversation,
)

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is my payout of $120.00?"},
    {"role": "assistant", "content": "It lands tomorrow."},
    {"role": "user", "content": "Thanks, and the refund on order #12345?"},
    {"role": "assistant", "content": "Refunds take five to ten business days."},
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare_demo_data(tmp_path_factory.mktemp("demo"), n=60, seed=0, vocab_size=512)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "hi"}', r"bad\.jsonl:2: the object has no 'messages' key"),
        ('{"messages": [{"role": "agent", "content": "hi"}]}', r"bad\.jsonl:2: .*unknown role 'agent'; use one of"),
        ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: messages\[0\] needs both 'role' and 'content'"),
        ('{"messages": []}', r"bad\.jsonl:2: 'messages' must be a non-empty list"),
        ('{"messages": [', r"bad\.jsonl:2: not valid JSON"),
    ],
)
def test_bad_lines_name_the_file_the_line_and_the_fix(tmp_path, line, message):
    good = json.dumps({"messages": CONV})
    path = _write(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(ValueError, match=message) as err:
        read_transcripts(path)
    assert "each line or row must be one JSON object like" in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl does not exist; .*write_jsonl"):
        read_transcripts(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="has no conversations"):
        read_transcripts(_write(tmp_path / "empty.jsonl", ["", "  "]))


def test_assistant_labels_cover_exactly_the_assistant_turns(demo):
    _, tok = demo
    row = tokenize_conversation(tok, CONV, max_seq_len=1000, loss_on="assistant")
    scored = [t for t in row["labels"] if t != -100]
    expected = tok("It lands tomorrow.<|end|>Refunds take five to ten business days.<|end|>", add_special_tokens=False)
    assert scored == expected["input_ids"]
    assert tok.decode(scored) == "It lands tomorrow.<|end|>Refunds take five to ten business days.<|end|>"
    every = tokenize_conversation(tok, CONV, max_seq_len=1000, loss_on="all")
    assert every["labels"] == every["input_ids"] == row["input_ids"]


def test_generation_blocks_and_prefix_renders_agree(demo):
    jsonl, tok = demo
    for record in read_transcripts(jsonl)[:20]:
        assert assistant_token_mask(tok, record["messages"], method="generation") == assistant_token_mask(
            tok, record["messages"], method="prefix"
        )


def test_template_that_is_not_prefix_stable_is_refused(demo):
    _, tok = demo
    unstable = copy.deepcopy(tok)
    unstable.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(ValueError, match=r"not prefix-stable.*\{% generation %\}"):
        assistant_token_mask(unstable, CONV)


def test_a_tokenizer_without_chat_template_is_refused(demo):
    jsonl, tok = demo
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; set tokenizer.chat_template"):
        build_datasets(jsonl, bare, max_seq_len=64)


def test_truncation_and_untrainable_rows(demo):
    _, tok = demo
    row = tokenize_conversation(tok, CONV, max_seq_len=12, loss_on="assistant")
    assert len(row["input_ids"]) == len(row["labels"]) == len(row["attention_mask"]) == 12
    assert all(label == -100 for label in row["labels"])  # the first assistant turn starts after 12 tokens


def test_build_datasets_split_is_seeded_and_disjoint(demo):
    jsonl, tok = demo
    train, eval_ = build_datasets(jsonl, tok, max_seq_len=128, loss_on="all", eval_fraction=0.2, seed=3)
    again, eval_again = build_datasets(jsonl, tok, max_seq_len=128, loss_on="all", eval_fraction=0.2, seed=3)
    assert len(train) == 48 and len(eval_) == 12
    assert train["input_ids"] == again["input_ids"] and eval_["input_ids"] == eval_again["input_ids"]
    assert not {tuple(x) for x in train["input_ids"]} & {tuple(x) for x in eval_["input_ids"]}
    assert set(train.column_names) == {"input_ids", "attention_mask", "labels"}
    assert max(len(x) for x in train["input_ids"]) == 128
    train_all, none = build_datasets(jsonl, tok, max_seq_len=128, loss_on="all", eval_fraction=0.0)
    assert none is None and len(train_all) == 60


def test_rows_left_without_trainable_tokens_are_dropped_with_a_warning(demo, caplog):
    jsonl, tok = demo
    with caplog.at_level(logging.WARNING, logger="hf_dist.data.transcripts"):
        train, _ = build_datasets(jsonl, tok, max_seq_len=40, loss_on="assistant", eval_fraction=0.0)
    dropped = 60 - len(train)
    assert dropped > 0 and f"dropped {dropped} of 60 conversations" in caplog.text
    assert all(any(t != -100 for t in labels[1:]) for labels in train["labels"])
    with pytest.raises(ValueError, match="no conversation has a trainable token with max_seq_len=3"):
        build_datasets(jsonl, tok, max_seq_len=3, loss_on="assistant", eval_fraction=0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_seq_len": 1}, "max_seq_len=1"),
        ({"max_seq_len": 64, "loss_on": "assistants"}, "loss_on='assistants'"),
        ({"max_seq_len": 64, "eval_fraction": 1.0}, "eval_fraction=1.0"),
    ],
)
def test_build_datasets_refuses_bad_arguments(demo, kwargs, message):
    jsonl, tok = demo
    with pytest.raises(ValueError, match=message):
        build_datasets(jsonl, tok, **kwargs)


def test_collator_pads_inputs_with_pad_and_labels_with_ignore(demo):
    jsonl, tok = demo
    train, _ = build_datasets(jsonl, tok, max_seq_len=96, loss_on="assistant", eval_fraction=0.0)
    rows = [train[i] for i in range(4)]
    batch = data_collator(tok)(rows)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, width)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
        assert batch["labels"][i, :n].tolist() == row["labels"]
        assert (batch["input_ids"][i, n:] == tok.pad_token_id).all()
        assert (batch["labels"][i, n:] == -100).all()
        assert batch["attention_mask"][i].sum().item() == n
    fixed = data_collator(tok, pad_to=128)(rows)
    assert fixed["input_ids"].shape == (4, 128) and fixed["labels"].dtype == torch.long

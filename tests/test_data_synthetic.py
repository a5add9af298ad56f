"""The synthetic merchant-support generator: determinism, schema, and the spread of lengths."""

import json
import statistics

import pytest

from hf_dist.data import LengthProfile, generate_conversations, write_jsonl
from hf_dist.data.synthetic import TOPICS


def test_same_seed_gives_byte_identical_file(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", 50, seed=7)
    b = write_jsonl(tmp_path / "b.jsonl", 50, seed=7)
    c = write_jsonl(tmp_path / "c.jsonl", 50, seed=8)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_one_conversation_per_line_with_alternating_roles(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", 200, seed=0)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 200
    with_system = 0
    for line in lines:
        record = json.loads(line)
        assert list(record) == ["messages"]
        roles = [m["role"] for m in record["messages"]]
        if roles[0] == "system":
            with_system += 1
            roles = roles[1:]
        assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(isinstance(m["content"], str) and m["content"] for m in record["messages"])
    assert 0 < with_system < 200  # the system prompt is optional, not always or never present


def test_lengths_have_a_long_tail_and_cover_all_topics():
    conversations = generate_conversations(2000, seed=1)
    words = [sum(len(m["content"].split()) for m in c["messages"]) for c in conversations]
    turns = [len(c["messages"]) for c in conversations]
    median = statistics.median(words)
    assert max(words) > 4 * median  # a long tail
    assert sorted(words)[int(0.9 * len(words))] > 1.8 * median
    assert min(turns) <= 3 and max(turns) >= 9
    assert {c["topic"] for c in conversations} == set(TOPICS)


def test_the_profile_shifts_lengths():
    short = generate_conversations(300, seed=2, profile=LengthProfile(words_median=5.0))
    long = generate_conversations(300, seed=2, profile=LengthProfile(words_median=40.0))

    def mean_words(convs):
        return statistics.mean(len(m["content"].split()) for c in convs for m in c["messages"] if m["role"] == "user")

    assert mean_words(long) > 2 * mean_words(short)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n=0"):
        generate_conversations(0)
    with pytest.raises(ValueError, match="words_sigma"):
        LengthProfile(words_sigma=0.0)

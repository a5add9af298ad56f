"""hf_dist.data.sources: the three data shapes, from Datasets and from every file type, and their errors."""

import json

import pytest
from datasets import Dataset, DatasetDict

from hf_dist.data import build_datasets, detect_shape, load_examples, prepare_demo_data, tokenize_examples

PAIRS = [
    {"prompt": f"Where is my refund for order {i}?", "completion": f"Refund {i} lands in five days."} for i in range(20)
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return prepare_demo_data(tmp_path_factory.mktemp("demo"), n=40, seed=0, vocab_size=400)[1]


def test_shapes_are_told_apart_by_columns_and_others_refused():
    assert detect_shape(["messages", "id"]) == "messages"
    assert detect_shape(["completion", "prompt"]) == "prompt_completion"
    assert detect_shape(["text"]) == "text"
    with pytest.raises(ValueError, match=r"columns \['input', 'output'\].*'messages'; 'prompt' \+ 'completion'; 'text'"):
        detect_shape(["input", "output"])


def test_prompt_completion_trains_on_the_completion_only(tok):
    rows = tokenize_examples(Dataset.from_list(PAIRS), tok, max_seq_len=64, loss_on="assistant")
    full = tokenize_examples(Dataset.from_list(PAIRS), tok, max_seq_len=64, loss_on="all")
    for row, everything, pair in zip(rows, full, PAIRS):
        n_prompt = len(tok(pair["prompt"])["input_ids"])
        assert row["input_ids"] == everything["input_ids"] and row["input_ids"][-1] == tok.eos_token_id
        assert row["labels"][:n_prompt] == [-100] * n_prompt
        assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
        assert everything["labels"] == everything["input_ids"]


def test_conversational_prompt_completion_goes_through_the_chat_template(tok):
    chat = [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "completion": [{"role": "assistant", "content": p["completion"]}]} for p in PAIRS[:4]]
    as_messages = [{"messages": c["prompt"] + c["completion"]} for c in chat]
    a = tokenize_examples(Dataset.from_list(chat), tok, max_seq_len=64)
    b = tokenize_examples(Dataset.from_list(as_messages), tok, max_seq_len=64)
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]


def test_long_texts_are_cut_into_pieces_not_truncated(tok):
    text = " ".join(f"payout {i} arrived" for i in range(60))
    rows = tokenize_examples(Dataset.from_list([{"text": text}]), tok, max_seq_len=32)
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    assert sum((r["input_ids"] for r in rows), []) == ids
    assert all(r["labels"] == r["input_ids"] and len(r["input_ids"]) <= 32 for r in rows) and len(rows) > 2


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_file_type_gives_the_same_rows(tok, tmp_path, suffix):
    path = tmp_path / f"pairs{suffix}"
    data = Dataset.from_list(PAIRS)
    {".jsonl": lambda: data.to_json(path, lines=True), ".json": lambda: path.write_text(json.dumps(PAIRS)),
     ".parquet": lambda: data.to_parquet(path), ".csv": lambda: data.to_csv(path, index=False)}[suffix]()
    from_file = build_datasets(path, tok, max_seq_len=64, eval_fraction=0.25, seed=1)
    in_memory = build_datasets(data, tok, max_seq_len=64, eval_fraction=0.25, seed=1)
    for a, b in zip(from_file, in_memory):
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
    assert len(from_file[0]) == 15 and len(from_file[1]) == 5


def test_a_text_file_is_one_text_per_line(tok, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("the payout arrived\nrefunds take five days\n")
    train, eval_ = build_datasets(path, tok, max_seq_len=64, eval_fraction=0.0)
    assert eval_ is None and sorted(len(r) for r in train["input_ids"]) == sorted(
        len(tok(line)["input_ids"]) + 1 for line in ("the payout arrived", "refunds take five days")
    )


def test_a_dataset_dict_uses_its_validation_split(tok):
    dd = DatasetDict(train=Dataset.from_list(PAIRS[:12]), validation=Dataset.from_list(PAIRS[12:15]))
    train, eval_ = build_datasets(dd, tok, max_seq_len=64, eval_fraction=0.5)
    assert len(train) == 12 and len(eval_) == 3
    with pytest.raises(ValueError, match=r"splits \['dev'\].*needs a 'train' split"):
        build_datasets(DatasetDict(dev=Dataset.from_list(PAIRS)), tok, max_seq_len=64)


def test_bad_inputs_name_the_fix(tok, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")
    (tmp_path / "data.xml").write_text("<x/>")
    with pytest.raises(ValueError, match=r"extension '.xml'.*\.jsonl"):
        load_examples(tmp_path / "data.xml")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl: datasets.load_dataset\('json'\) could not read it"):
        load_examples(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("")  # datasets itself raised with an empty message
    with pytest.raises(ValueError, match=r"empty.jsonl holds no rows \(0 bytes"):
        load_examples(tmp_path / "empty.jsonl")
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank.txt holds no rows .*write at least one row"):
        load_examples(tmp_path / "blank.txt")
    (tmp_path / "header.csv").write_text("text\n")  # parses, to zero rows
    with pytest.raises(ValueError, match=r"header.csv holds no rows"):
        load_examples(tmp_path / "header.csv")
    bad_role = Dataset.from_list([{"messages": [{"role": "bot", "content": "hi"}]}])
    with pytest.raises(ValueError, match="row 0: messages\\[0\\] has unknown role 'bot'"):
        tokenize_examples(bad_role, tok, max_seq_len=32)
    with pytest.raises(ValueError, match="row 0: 'text' must be a string"):
        tokenize_examples(Dataset.from_list([{"text": 3}]), tok, max_seq_len=32)

"""hf_dist.data.sources: the three data shapes, from Datasets and from every file type, and their errors."""

import json

import pytest
from datasets import Dataset, DatasetDict

from hf_dist.data import (
    build_datasets,
    detect_shape,
    held_out_prompts,
    load_examples,
    prepare_demo_data,
    tokenize_examples,
)

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


def test_held_out_prompts_are_the_eval_rows_in_their_trained_form(tok, tmp_path):
    """--show_answers on your data: the prompts of the rows build_datasets held out (same fraction and seed), a chat
    up to its first reply, a prompt string as plain text, the first half of a text."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    prompts = held_out_prompts(path, 3, eval_fraction=0.2, seed=1)
    _, held = build_datasets(path, tok, max_seq_len=64, eval_fraction=0.2, seed=1)
    expected = [tok(p["prompt"])["input_ids"] for p in PAIRS if p["prompt"] in prompts]
    assert len(prompts) == 3 and all(isinstance(p, str) for p in prompts) and len(expected) == 3
    held_prompts = [row["input_ids"][:len(e)] for row in held for e in expected if row["input_ids"][:len(e)] == e]
    assert len(held_prompts) == 3, "every prompt is a held-out row's"
    assert held_out_prompts(path, 50, eval_fraction=0.2, seed=1) == held_out_prompts(path, 4, eval_fraction=0.2,
                                                                                     seed=1)  # 4 held out of 20
    assert len(held_out_prompts(path, 50, eval_fraction=0.0)) == 20  # nothing held out: the training rows

    chats = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p["prompt"]},
                           {"role": "assistant", "content": p["completion"]},
                           {"role": "user", "content": "Thanks"}]} for p in PAIRS]
    for prompt in held_out_prompts(Dataset.from_list(chats), 2, eval_fraction=0.2):
        assert [m["role"] for m in prompt] == ["system", "user"] and prompt[1]["content"].startswith("Where is")
    lists = [{"prompt": [{"role": "user", "content": p["prompt"]}],
              "completion": [{"role": "assistant", "content": p["completion"]}]} for p in PAIRS]
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in held_out_prompts(Dataset.from_list(lists), 2))
    texts = Dataset.from_list([{"text": "word " * 100}, {"text": "abcdef"}])
    assert held_out_prompts(texts, 2, eval_fraction=0.0) in (["word " * 40, "abc"], ["abc", "word " * 40])
    with pytest.raises(ValueError, match=r"n=0: ask for at least one prompt"):
        held_out_prompts(path, 0)


def test_greedy_answer_continues_plain_text_as_trained(tok):
    """A model trained on prompt/completion strings or text continues plain text (no chat template around it)."""
    import torch

    from hf_dist.models import build_tiny_model, greedy_answer, tiny_llama_config

    model = build_tiny_model(tiny_llama_config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1), seed=0)
    prompt = PAIRS[0]["prompt"]
    ids = torch.tensor([tok(prompt)["input_ids"]])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                              pad_token_id=tok.pad_token_id)
    answer = greedy_answer(model, tok, prompt, max_new_tokens=5, chat=False)
    assert answer == tok.decode(expected[0, ids.shape[1]:], skip_special_tokens=True).strip()
    with pytest.raises(ValueError, match=r"chat=False takes plain text, not list"):
        greedy_answer(model, tok, [{"role": "user", "content": prompt}], chat=False)

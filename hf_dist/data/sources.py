"""Data as users bring it -> tokenized ``(train, eval)`` datasets for causal-LM fine-tuning.

What it is for: a ``datasets.Dataset`` / ``DatasetDict`` or any file ``datasets.load_dataset`` reads
(``.json``, ``.jsonl``, ``.parquet``, ``.csv``, ``.txt``), in one of three shapes, told apart by the columns:

- ``messages``: chat conversations (``[{"role", "content"}, ...]``), rendered with the tokenizer's chat template
  (``hf_dist.data.transcripts``); ``loss_on="assistant"`` trains on the assistant turns only.
- ``prompt`` / ``completion``: strings are joined as plain text (prompt, completion, eos); lists of messages are a
  chat (prompt messages then completion messages) and go through the chat template. ``loss_on="assistant"``
  trains on the completion only.
- ``text``: continued pre-training. Every token is trained on (``loss_on`` does not apply); each text gets an
  eos and is cut into consecutive pieces of ``max_seq_len`` tokens, so nothing is dropped by truncation. A
  ``.txt`` file gives one text per line (``load_dataset("text")``).

A ``DatasetDict`` (or a file) gives the train split ``train``; the eval split is ``validation`` or ``test`` when
present, else ``eval_fraction`` of the examples, split with ``seed``. Unknown shapes, missing splits and bad rows
stop with a ``ValueError`` naming what was expected.

What it is not: a streaming pipeline (everything is tokenized in memory), nor a template engine; packing lives in
``hf_dist.data.packing``.
"""

from __future__ import annotations

from pathlib import Path

from hf_dist.data.transcripts import (
    IGNORE_INDEX,
    LossOn,
    check_args,
    check_record,
    keep_trainable,
    tokenize_transcripts,
)

SHAPES: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
FILE_BUILDERS: dict[str, str] = {
    ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text",
}
EVAL_SPLITS: tuple[str, ...] = ("validation", "test")


def _expected_columns() -> str:
    return "; ".join(" + ".join(repr(c) for c in cols) for cols in SHAPES.values())


def load_examples(source):
    """``source`` as a ``Dataset`` or ``DatasetDict``: passed through, or read from a file by its extension."""
    from datasets import Dataset, DatasetDict, load_dataset

    if isinstance(source, (Dataset, DatasetDict)):
        return source
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist; pass a file with one of {', '.join(FILE_BUILDERS)}")
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"data file {path} has extension {path.suffix!r}, which hf_dist does not read; use one of "
            f"{', '.join(FILE_BUILDERS)}, or load it yourself and pass a datasets.Dataset"
        )
    with path.open("rb") as file:
        head = file.read(65537)
    if len(head) <= 65536 and not head.strip():  # empty, or blank lines only: datasets says nothing useful
        raise _no_rows(path)
    try:
        loaded = load_dataset(builder, data_files={"train": str(path)})
    except Exception as err:  # datasets raises many types; the user needs the file and the reader
        if "corresponds to no data" in str(err):  # datasets' words for a file that parsed to zero rows
            raise _no_rows(path) from err
        reason = str(err) or type(err).__name__
        raise ValueError(f"data file {path}: datasets.load_dataset({builder!r}) could not read it: {reason}") from err
    if len(loaded["train"]) == 0:
        raise _no_rows(path)
    return loaded


def _no_rows(path: Path) -> ValueError:
    return ValueError(
        f"data file {path} holds no rows ({path.stat().st_size} bytes, no examples); write at least one row with "
        f"the columns of one shape ({_expected_columns()}), or point --data_path at the intended file"
    )


def detect_shape(columns: list[str], where: str = "the dataset") -> str:
    """``"messages"``, ``"prompt_completion"`` or ``"text"`` from the column names; anything else is an error."""
    for shape, needed in SHAPES.items():
        if all(column in columns for column in needed):
            return shape
    raise ValueError(f"{where} has columns {sorted(columns)}; hf_dist expects one of: {_expected_columns()}")


def _split(raw, *, eval_fraction: float, seed: int, where: str):
    from datasets import DatasetDict

    if isinstance(raw, DatasetDict):
        if "train" not in raw:
            raise ValueError(f"{where} has splits {sorted(raw)}; it needs a 'train' split (and optionally "
                             f"{' or '.join(repr(s) for s in EVAL_SPLITS)})")
        held_out = next((raw[name] for name in EVAL_SPLITS if name in raw), None)
        if held_out is not None:
            return raw["train"], held_out
        raw = raw["train"]
    if eval_fraction > 0:
        split = raw.train_test_split(test_size=eval_fraction, seed=seed)
        return split["train"], split["test"]
    return raw.shuffle(seed=seed), None


def _as_messages(dataset, shape: str, where: str) -> list[dict]:
    if shape == "messages":
        return [check_record(f"{where} row {i}", {"messages": row["messages"]}) for i, row in enumerate(dataset)]
    records = []
    for i, row in enumerate(dataset):
        if not isinstance(row["prompt"], list) or not isinstance(row["completion"], list):
            raise ValueError(f"{where} row {i}: 'prompt' and 'completion' must both be lists of messages; "
                             "give both as lists of {'role', 'content'} or both as strings")
        records.append(check_record(f"{where} row {i}", {"messages": list(row["prompt"]) + list(row["completion"])}))
    return records


def _plain_rows(dataset, tokenizer, shape: str, *, max_seq_len: int, loss_on: LossOn, where: str) -> list[dict]:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token; set tokenizer.eos_token first")
    rows = []
    for i, row in enumerate(dataset):
        if shape == "text":
            if not isinstance(row["text"], str):
                raise ValueError(f"{where} row {i}: 'text' must be a string, not {type(row['text']).__name__}")
            ids = tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]
            pieces = [ids[start:start + max_seq_len] for start in range(0, len(ids), max_seq_len)]
            rows += [{"input_ids": p, "attention_mask": [1] * len(p), "labels": list(p)} for p in pieces if len(p) > 1]
            continue
        prompt, completion = row["prompt"], row["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f"{where} row {i}: 'prompt' and 'completion' must both be strings (or both lists "
                             "of {'role', 'content'} messages)")
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        masked = [IGNORE_INDEX] * len(prompt_ids) if loss_on == "assistant" else list(prompt_ids)
        ids, labels = (prompt_ids + completion_ids)[:max_seq_len], (masked + completion_ids)[:max_seq_len]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


def tokenize_examples(
    dataset, tokenizer, *, max_seq_len: int, loss_on: LossOn = "assistant", where: str = "the dataset"
):
    """Tokenize a dataset of any of the three shapes into ``input_ids`` / ``attention_mask`` / ``labels`` rows."""
    from datasets import Dataset

    check_args(max_seq_len, loss_on, 0.0)
    shape = detect_shape(dataset.column_names, where)
    conversational = shape == "prompt_completion" and len(dataset) > 0 and isinstance(dataset[0]["prompt"], list)
    if shape == "messages" or conversational:
        return tokenize_transcripts(
            Dataset.from_list(_as_messages(dataset, shape, where)), tokenizer, max_seq_len=max_seq_len, loss_on=loss_on
        )
    rows = _plain_rows(dataset, tokenizer, shape, max_seq_len=max_seq_len, loss_on=loss_on, where=where)
    what = "texts" if shape == "text" else "examples"
    return Dataset.from_list(keep_trainable(rows, what=what, max_seq_len=max_seq_len, loss_on=loss_on))


def build_datasets(
    source,
    tokenizer,
    *,
    max_seq_len: int,
    loss_on: LossOn = "assistant",
    eval_fraction: float = 0.1,
    seed: int = 0,
    packed: bool = False,
):
    """``(train, eval)`` tokenized datasets from ``source`` (see the module docstring for what it accepts).

    Args:
        source: a ``datasets.Dataset`` / ``DatasetDict``, or the path of a ``.json(l)``/``.parquet``/``.csv``/
            ``.txt`` file with ``messages``, ``prompt``/``completion`` or ``text`` columns.
        tokenizer: the model's tokenizer (a chat template is needed for ``messages``).
        max_seq_len: tokens per sequence; longer examples are truncated (texts are cut into pieces).
        loss_on: ``"all"`` or ``"assistant"`` (assistant turns, or the completion; not used for ``text``).
        eval_fraction: share held out for evaluation when there is no eval split; 0 gives ``eval = None``.
        seed: the split's seed.
        packed: pack several examples per sequence of ``max_seq_len`` (``hf_dist.data.pack_dataset``);
            feed the result to ``data_collator(tokenizer, packed=True)``.

    Rows have ``input_ids``, ``attention_mask``, ``labels`` (or, packed, ``input_ids``, ``labels``,
    ``position_ids``).
    """
    check_args(max_seq_len, loss_on, eval_fraction)
    where = str(source) if isinstance(source, (str, Path)) else "the dataset"
    parts = _split(load_examples(source), eval_fraction=eval_fraction, seed=seed, where=where)
    out = [
        None if part is None
        else tokenize_examples(part, tokenizer, max_seq_len=max_seq_len, loss_on=loss_on, where=where)
        for part in parts
    ]
    if packed:
        from hf_dist.data.packing import pack_dataset

        out = [None if part is None else pack_dataset(part, max_seq_len=max_seq_len) for part in out]
    return out[0], out[1]


def held_out_prompts(source, n: int, *, eval_fraction: float = 0.1, seed: int = 0) -> list[list[dict] | str]:
    """The prompts of ``n`` examples ``build_datasets`` (same ``source``, ``eval_fraction``, ``seed``) holds out, to
    see what a model answers before and after training (``hf_dist.models.greedy_answer``).

    Each prompt is what the model is trained to continue, in the form it was trained on: a chat (``messages``, or
    ``prompt`` / ``completion`` given as messages) gives its messages up to the first assistant turn, a list for
    the chat template; ``prompt`` / ``completion`` strings give the prompt string, and ``text`` the first half of a
    text (at most 200 characters), both continued as plain text (``greedy_answer(..., chat=False)``). Rows come from
    the eval split, or, when nothing is held out (``eval_fraction=0``, no eval split), from the training rows.
    """
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one prompt")
    where = str(source) if isinstance(source, (str, Path)) else "the dataset"
    train, held_out = _split(load_examples(source), eval_fraction=eval_fraction, seed=seed, where=where)
    rows = held_out if held_out is not None and len(held_out) > 0 else train
    shape = detect_shape(rows.column_names, where)
    prompts: list[list[dict] | str] = []
    for row in rows:
        if shape == "text":
            text = row["text"] if isinstance(row["text"], str) else ""
            prompt = text[:min(len(text) // 2, 200)]
        elif shape == "prompt_completion" and isinstance(row["prompt"], str):
            prompt = row["prompt"]
        else:
            messages = row["messages"] if shape == "messages" else list(row["prompt"])
            first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
            prompt = list(messages[:first_reply])
            if not any(m.get("role") == "user" for m in prompt):
                continue
        if prompt:
            prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts

"""Support transcripts in JSONL -> tokenized ``datasets.Dataset`` for causal-LM fine-tuning with the HF Trainer.

What it is for: one conversation per line, ``{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}``, rendered with the tokenizer's chat template, tokenized, truncated to
``max_seq_len`` and labelled for the loss on every token (``loss_on="all"``) or on the assistant turns only
(``loss_on="assistant"``: every other token is -100). Bad input stops with a ``ValueError`` naming the file,
the line and the fix; nothing is skipped silently.

Assistant spans come from the template itself: with ``{% generation %}`` blocks (the tokenizer trained by
``hf_dist.data.tokenizer`` has them) through ``apply_chat_template(return_assistant_tokens_mask=True)``;
otherwise by rendering each conversation prefix and checking that every render extends the previous one
(a template that is not prefix-stable is refused, with the fix).

What it is not: a streaming loader for the 2.4M-transcript corpus; it reads the file into memory. Other shapes
of data (``prompt``/``completion``, plain ``text``), other file types and the train/eval split live in
``hf_dist.data.sources``; packing several conversations per sequence lives in ``hf_dist.data.packing``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Literal

IGNORE_INDEX = -100
ROLES: tuple[str, ...] = ("system", "user", "assistant")
LossOn = Literal["all", "assistant"]
LOSS_ON: tuple[str, ...] = ("all", "assistant")
EXAMPLE_LINE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'

logger = logging.getLogger(__name__)


def _record_error(where: str, problem: str) -> ValueError:
    return ValueError(f"{where}: {problem}; each line or row must be one JSON object like {EXAMPLE_LINE}")


def check_record(where: str, record: object) -> dict:
    """A validated ``{"messages": [...]}`` record; ``where`` names it in the error (``"file.jsonl:3"``, ``"row 7"``)."""
    if not isinstance(record, dict) or "messages" not in record:
        raise _record_error(where, "the object has no 'messages' key")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _record_error(where, "'messages' must be a non-empty list of {'role', 'content'} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise _record_error(where, f"messages[{index}] needs both 'role' and 'content'")
        if message["role"] not in ROLES:
            raise _record_error(
                where, f"messages[{index}] has unknown role {message['role']!r}; use one of {', '.join(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise _record_error(where, f"messages[{index}].content must be a string")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}


def read_transcripts(path: str | Path) -> list[dict]:
    """Read and validate a transcripts JSONL: a list of ``{"messages": [...]}`` (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"transcripts file {path} does not exist; pass the path of a JSONL file, or write a synthetic one "
            f"with hf_dist.data.write_jsonl({str(path)!r}, n=500, seed=0)"
        )
    records = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise _record_error(f"{path}:{lineno}", f"not valid JSON ({err.msg} at column {err.colno})") from None
            records.append(check_record(f"{path}:{lineno}", record))
    if not records:
        raise ValueError(f"transcripts file {path} has no conversations; it needs one per line like {EXAMPLE_LINE}")
    return records


def load_transcripts(path: str | Path):
    """A ``datasets.Dataset`` with one column ``messages`` from a validated transcripts JSONL."""
    from datasets import Dataset

    return Dataset.from_list(read_transcripts(path))


def _has_generation_block(template: str | None) -> bool:
    return bool(template) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _prefix_assistant_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Assistant tokens found by rendering prefixes: the span of turn i is render(<=i) minus render(<i)+prompt."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(
                "the tokenizer's chat template is not prefix-stable (rendering the first messages of a "
                "conversation is not a prefix of rendering all of them), so assistant tokens cannot be located; "
                "wrap the assistant content in {% generation %}...{% endgeneration %} in the template, "
                "or use loss_on='all'"
            )
        spans.append((len(before), len(upto)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(start < span_end and end > span_start for span_start, span_end in spans))
        for start, end in encoded["offset_mapping"]
    ]
    return list(encoded["input_ids"]), mask


def assistant_token_mask(tokenizer, messages: list[dict], *, method: str = "auto") -> tuple[list[int], list[int]]:
    """``(input_ids, mask)`` of the rendered conversation; ``mask[t] == 1`` on assistant-turn tokens.

    ``method``: ``"generation"`` ({% generation %} blocks), ``"prefix"`` (prefix renders) or ``"auto"``
    (generation blocks when the template has them).
    """
    if method not in ("auto", "generation", "prefix"):
        raise ValueError(f"method={method!r} is not known; use 'auto', 'generation' or 'prefix'")
    if method == "prefix" or (method == "auto" and not _has_generation_block(tokenizer.chat_template)):
        return _prefix_assistant_mask(tokenizer, messages)
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def tokenize_conversation(tokenizer, messages: list[dict], *, max_seq_len: int, loss_on: LossOn = "assistant") -> dict:
    """Render, tokenize, label and truncate one conversation: ``{"input_ids", "attention_mask", "labels"}``."""
    if loss_on == "assistant":
        input_ids, mask = assistant_token_mask(tokenizer, messages)
        labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(input_ids, mask)]
    else:
        input_ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        labels = list(input_ids)
    input_ids, labels = input_ids[:max_seq_len], labels[:max_seq_len]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def check_args(max_seq_len: int, loss_on: str, eval_fraction: float) -> None:
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len!r} must be an integer >= 2 (tokens per sequence)")
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on={loss_on!r} is not known; use 'all' (every token) or 'assistant' (assistant turns)")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r} must be in [0, 1): the share of conversations held out")


def keep_trainable(rows: list[dict], *, what: str, max_seq_len: int, loss_on: str) -> list[dict]:
    """The rows with at least one trainable label; the others are dropped with a warning saying how many.

    A row has no trainable token when, e.g., ``loss_on="assistant"`` and truncation cut every assistant turn
    (or the whole completion). Such rows would give a 0/0 loss. None left at all is an error.
    """
    kept = [row for row in rows if any(label != IGNORE_INDEX for label in row["labels"][1:])]
    if not kept:
        raise ValueError(
            f"no {what[:-1]} has a trainable token with max_seq_len={max_seq_len} and loss_on={loss_on!r}; "
            "raise max_seq_len or use loss_on='all'"
        )
    if len(kept) < len(rows):
        logger.warning(
            "dropped %d of %d %s with no trainable token (max_seq_len=%d, loss_on=%r)",
            len(rows) - len(kept), len(rows), what, max_seq_len, loss_on,
        )
    return kept


def tokenize_transcripts(dataset, tokenizer, *, max_seq_len: int, loss_on: LossOn = "assistant"):
    """Tokenize a ``messages`` dataset; conversations left with no trainable token are dropped (``keep_trainable``)."""
    from datasets import Dataset

    check_args(max_seq_len, loss_on, 0.0)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} has no chat template; "
            "set tokenizer.chat_template to a Jinja template (hf_dist.data.tokenizer.CHAT_TEMPLATE is one, with "
            "{% generation %} blocks), or train one with hf_dist.data.train_tokenizer"
        )
    rows = [tokenize_conversation(tokenizer, r["messages"], max_seq_len=max_seq_len, loss_on=loss_on) for r in dataset]
    kept = keep_trainable(rows, what="conversations", max_seq_len=max_seq_len, loss_on=loss_on)
    return Dataset.from_list(kept)


def data_collator(
    tokenizer,
    *,
    packed: bool = False,
    pad_to: int | None = None,
    pad_to_multiple_of: int | None = None,
    attn_implementation: str | None = None,
    cp_size: int = 1,
):
    """The collator for ``build_datasets`` output.

    Unpacked: transformers' ``DataCollatorForSeq2Seq`` (pads ``input_ids`` with the pad token,
    ``attention_mask`` with 0 and ``labels`` with -100), to the longest row or to ``pad_to`` tokens.
    Packed: ``hf_dist.data.PackedCollator``; pass the model's ``config._attn_implementation`` as
    ``attn_implementation`` so that flash attention gets its varlen boundaries (see ``hf_dist.data.packing``).
    ``cp_size``: the run's context-parallel degree (``DistTrainingArguments.layout.cp``). Every rank holds an equal
    slice of each sequence, so every batch is padded to a multiple of it as well (the padding is labelled -100 and
    attended by no real token: the loss is that of the unpadded batch).
    """
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its eos token) first")
    multiple = pad_multiple(pad_to_multiple_of, cp_size)
    if packed:
        from hf_dist.data.packing import PackedCollator

        return PackedCollator(
            pad_token_id=tokenizer.pad_token_id,
            pad_to=pad_to,
            pad_to_multiple_of=multiple,
            flash_attn_kwargs="flash" in (attn_implementation or ""),
        )
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer,
        padding="max_length" if pad_to else "longest",
        max_length=pad_to,
        pad_to_multiple_of=multiple,
        label_pad_token_id=IGNORE_INDEX,
        return_tensors="pt",
    )


def pad_multiple(pad_to_multiple_of: int | None, cp_size: int) -> int | None:
    """The length every batch is padded to a multiple of: ``pad_to_multiple_of`` and ``cp_size`` both (None: any)."""
    from math import lcm

    for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("cp_size", cp_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer (or None / 1: no constraint)")
    multiple = lcm(pad_to_multiple_of or 1, cp_size)
    return multiple if multiple > 1 else None

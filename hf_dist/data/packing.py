"""Sequence packing: several tokenized conversations per training sequence, with no attention across them.

What it is for: support transcripts are short, so a batch padded to the context length is mostly padding.
``pack_dataset`` fills rows of ``max_seq_len`` tokens with whole conversations (first fit, in dataset
order) and gives every token a ``position_ids`` value that restarts at 0 for each conversation.
``PackedCollator`` stacks such rows and pads the tail of each row as one more, separate, "sequence".

How the separation is exact: the collator emits ``position_ids`` and no ``attention_mask``. transformers
(5.x) then detects the packed format from the position resets (``masking_utils.find_packed_sequence_indices``)
and builds a block-diagonal causal mask per row (tested here with ``sdpa`` and ``eager``; ``flex_attention``
goes through the same mask function, untested on CPU). Rotary embeddings use
the restarted positions. The first label of every conversation is set to -100: in the unpacked batch it is
never predicted (the loss shifts labels by one), and in a packed row it would be predicted from the previous
conversation's last token. So the loss over a packed batch equals the token-weighted loss of the same
conversations unpacked (``tests/test_packing.py`` checks it on the tiny Llama).

Flash attention (``flash_attention_2/3``, GPUs) does not build masks: transformers infers varlen boundaries
from ``position_ids`` only when the batch has ONE row (``_is_packed_sequence`` requires batch size 1); with
more rows it would silently attend across conversations. ``PackedCollator(flash_attn_kwargs=True)`` (set by
``data_collator(..., attn_implementation="flash_attention_2")``) therefore also emits ``cu_seq_lens_q/k``
and ``max_length_q/k`` over the flattened batch, which transformers passes to the varlen kernel.

The one condition: the model must run without a KV cache (``use_cache=False``), because transformers only
looks for packed sequences when there is none. The Trainer guarantees this (``TrainingArguments.use_cache``
defaults to False and the Trainer writes it to ``model.config.use_cache``); a hand-written loop must pass
``use_cache=False``. ``check_model_for_packing(model, collator)`` turns both conditions into errors.

What it is not: a streaming packer; it packs an in-memory dataset.
"""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100


def first_fit_bins(lengths: list[int], capacity: int, *, max_open_bins: int = 64) -> list[list[int]]:
    """Group item indices into bins of total length <= ``capacity``, first fit in the given order.

    At most ``max_open_bins`` bins stay open; when one more is needed the fullest is closed, which keeps
    the cost at O(items x max_open_bins) for large datasets. Every index appears exactly once.
    """
    if capacity < 1 or max_open_bins < 1:
        raise ValueError(f"capacity={capacity} and max_open_bins={max_open_bins} must both be >= 1")
    closed: list[list[int]] = []
    open_bins: list[tuple[int, list[int]]] = []  # (free tokens, indices)
    for index, length in enumerate(lengths):
        if length > capacity or length < 1:
            raise ValueError(
                f"item {index} has {length} tokens, outside [1, {capacity}]; truncate to max_seq_len={capacity} "
                "first (build_datasets does) and drop empty rows"
            )
        for slot, (free, members) in enumerate(open_bins):
            if length <= free:
                members.append(index)
                open_bins[slot] = (free - length, members)
                break
        else:
            if len(open_bins) == max_open_bins:
                fullest = min(range(len(open_bins)), key=lambda s: open_bins[s][0])
                closed.append(open_bins.pop(fullest)[1])
            open_bins.append((capacity - length, [index]))
    closed.extend(members for _, members in open_bins)
    return sorted(closed, key=lambda members: members[0])


def pack_rows(rows: list[dict]) -> dict:
    """Concatenate tokenized rows into one packed row: ``input_ids``, ``labels``, ``position_ids``."""
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        ids = list(row["input_ids"])
        labels = list(row["labels"]) if "labels" in row else list(ids)
        packed["input_ids"] += ids
        packed["labels"] += [IGNORE_INDEX] + labels[1:]
        packed["position_ids"] += list(range(len(ids)))
    return packed


def pack_dataset(dataset, *, max_seq_len: int, max_open_bins: int = 64):
    """A ``datasets.Dataset`` of packed rows (each <= ``max_seq_len`` tokens) from a tokenized dataset.

    Input rows need ``input_ids`` (and usually ``labels``; without them every token is a label), each at
    most ``max_seq_len`` long. Output rows: ``input_ids``, ``labels``, ``position_ids``.
    """
    from datasets import Dataset

    lengths = [len(ids) for ids in dataset["input_ids"]]
    bins = first_fit_bins(lengths, max_seq_len, max_open_bins=max_open_bins)
    columns = [c for c in ("input_ids", "labels") if c in dataset.column_names]
    rows = dataset.select_columns(columns).to_list()
    return Dataset.from_list([pack_rows([rows[i] for i in members]) for members in bins])


@dataclass(kw_only=True)
class PackedCollator:
    """Stacks packed rows into a batch for a causal LM: ``input_ids``, ``labels``, ``position_ids``.

    No ``attention_mask`` on purpose: its absence is what makes transformers derive the per-conversation
    masking from ``position_ids``. The padding at the end of a row gets its own positions from 0 (a separate
    pseudo-sequence that no real token attends to) and labels -100.
    """

    pad_token_id: int
    """Token id written into the padding."""
    pad_to: int | None = None
    """Pad every row to this many tokens (static shapes); None pads to the longest row of the batch."""
    pad_to_multiple_of: int | None = None
    """Round the padded length up to a multiple of this (e.g. 8 or 64 for tensor cores)."""
    flash_attn_kwargs: bool = False
    """Also emit ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` over the flattened batch, for flash
    attention's varlen kernels (needed with more than one row per batch; sdpa and eager ignore them)."""

    def __call__(self, features: list[dict]) -> dict:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        width = self.pad_to or longest
        if longest > width:
            raise ValueError(
                f"a packed row has {longest} tokens but pad_to={self.pad_to}; pack with max_seq_len <= pad_to"
            )
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            ids, labels, positions = (list(feature[k]) for k in ("input_ids", "labels", "position_ids"))
            pad = width - len(ids)
            batch["input_ids"].append(ids + [self.pad_token_id] * pad)
            batch["labels"].append(labels + [IGNORE_INDEX] * pad)
            batch["position_ids"].append(positions + list(range(pad)))
        out = {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
        if self.flash_attn_kwargs:
            out.update(flash_attn_kwargs_from_positions(out["position_ids"]))
        return out


def flash_attn_kwargs_from_positions(position_ids) -> dict:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` for the flattened ``(batch x seq)`` tokens: a sequence
    starts wherever the position is 0 (and at the start of every row)."""
    import torch

    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids must start every row at 0 (packed rows from pack_dataset do)")
    bounds = starts + [flat.numel()]
    cu_seq_lens = torch.tensor(bounds, dtype=torch.int32)
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
    }


MASKING_ATTENTION = ("sdpa", "eager", "flex_attention")


def check_model_for_packing(model, collator: PackedCollator) -> None:
    """Refuse a model/collator pair under which packed conversations would silently attend to each other.

    Call it after ``Trainer.__init__`` (which copies ``TrainingArguments.use_cache`` into the config) or
    before a hand-written loop.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no config; packing needs a transformers model")
    if getattr(config, "use_cache", False):
        raise ValueError(
            "model.config.use_cache=True: transformers only derives the per-conversation mask from position_ids "
            "when no KV cache is built, so packed conversations would attend to each other; set "
            "model.config.use_cache=False (the Trainer does, from TrainingArguments.use_cache=False)"
        )
    # under context parallelism the model's own implementation runs inside hf_dist's all-to-all, on the whole
    # sequence and with the mask the model built for it (hf_dist.context_parallel.attention)
    from hf_dist.context_parallel.attention import CP_PREFIX

    attn = (getattr(config, "_attn_implementation", None) or "eager").removeprefix(CP_PREFIX)
    if "flash" in attn and not collator.flash_attn_kwargs:
        raise ValueError(
            f"attn_implementation={attn!r} needs varlen boundaries for multi-row packed batches; build the "
            f"collator with data_collator(tokenizer, packed=True, attn_implementation={attn!r})"
        )
    if "flash" not in attn and attn not in MASKING_ATTENTION:
        raise ValueError(
            f"attn_implementation={attn!r} is not known to honour packed position_ids; use one of "
            f"{', '.join(MASKING_ATTENTION)} or a flash_attention_* implementation"
        )


def packing_stats(dataset, *, seq_len: int) -> dict[str, float]:
    """Tokens, rows and fill ratio (real tokens / (rows x seq_len)) of a packed or unpacked dataset."""
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    rows = len(dataset)
    return {"rows": rows, "tokens": tokens, "fill": tokens / (rows * seq_len) if rows else 0.0}

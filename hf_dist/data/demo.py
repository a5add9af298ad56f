"""One call that prepares the offline data of the tiny demo and the tests: transcripts + a trained tokenizer.

Not for real runs: those bring their own transcripts and the checkpoint's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from hf_dist.data.synthetic import write_jsonl
from hf_dist.data.tokenizer import train_tokenizer


def prepare_demo_data(out_dir: str | Path, *, n: int = 400, seed: int = 0, vocab_size: int = 1024):
    """Write ``out_dir/transcripts.jsonl`` (``n`` synthetic conversations from ``seed``) and train a chat
    tokenizer on it into ``out_dir/tokenizer``. Returns ``(jsonl_path, tokenizer)``; same arguments, same files.
    """
    out_dir = Path(out_dir)
    jsonl_path = write_jsonl(out_dir / "transcripts.jsonl", n, seed)
    tokenizer = train_tokenizer(jsonl_path, out_dir / "tokenizer", vocab_size=vocab_size)
    return jsonl_path, tokenizer

"""Train a small byte-level BPE chat tokenizer offline and save it as a Hugging Face tokenizer directory.

What it is for: the CPU twin of the recipe cannot download the 13B model's tokenizer, so it trains its own
on local text (the synthetic transcripts) with the ``tokenizers`` library, adds the special tokens a chat
model needs (bos, eos, pad and one marker per role) and a Jinja chat template whose assistant turns sit in
``{% generation %}`` blocks, so ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks them.
The saved directory loads with ``AutoTokenizer.from_pretrained(dir)``.

What it is not: a tokenizer for real models. With a real checkpoint, use that checkpoint's tokenizer; the
dataset code in ``hf_dist.data.transcripts`` works with any tokenizer that has a chat template.

The rendered format (``eos`` also ends every turn, so generation stops at the end of a reply)::

    <|begin|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

BOS = "<|begin|>"
EOS = "<|end|>"
PAD = "<|pad|>"
ROLES: tuple[str, ...] = ("system", "user", "assistant")
ROLE_MARKERS: tuple[str, ...] = tuple(f"<|{role}|>" for role in ROLES)
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS) + ROLE_MARKERS
BYTE_ALPHABET_SIZE = 256

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _check_vocab_size(vocab_size: int) -> None:
    minimum = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if not isinstance(vocab_size, int) or vocab_size <= minimum:
        raise ValueError(
            f"vocab_size={vocab_size!r} is too small: a byte-level BPE needs {BYTE_ALPHABET_SIZE} byte tokens "
            f"+ {len(SPECIAL_TOKENS)} special tokens = {minimum}; use vocab_size > {minimum} (e.g. 1024)"
        )


def train_tokenizer_from_texts(texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 1024):
    """Train a byte-level BPE on ``texts``, save it to ``out_dir`` and return it as ``PreTrainedTokenizerFast``.

    Args:
        texts: the training text (e.g. every turn of every transcript). Iterated once.
        out_dir: directory to write (created); loadable afterwards with ``AutoTokenizer.from_pretrained``.
        vocab_size: total vocabulary including the 256 byte tokens and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _check_vocab_size(vocab_size)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_MARKERS),
        padding_side="right",
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def iter_transcript_texts(jsonl_path: str | Path) -> Iterator[str]:
    """Every message content of a transcripts JSONL (validated like ``load_transcripts``)."""
    from hf_dist.data.transcripts import read_transcripts

    for record in read_transcripts(jsonl_path):
        for message in record["messages"]:
            yield message["content"]


def train_tokenizer(jsonl_path: str | Path, out_dir: str | Path, *, vocab_size: int = 1024):
    """Train the chat tokenizer on the message texts of a transcripts JSONL; see ``train_tokenizer_from_texts``."""
    return train_tokenizer_from_texts(iter_transcript_texts(jsonl_path), out_dir, vocab_size=vocab_size)


def special_token_ids(tokenizer) -> dict[str, int]:
    """The ids a model config needs from this tokenizer: ``{"bos_token_id", "eos_token_id", "pad_token_id"}``."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


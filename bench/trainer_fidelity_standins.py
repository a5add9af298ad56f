"""Offline stand-ins for the Hub fixtures transformers' Trainer tests name (see ``trainer_fidelity``).

Nothing is fetched. Written once per work folder: a Hub-layout cache (``HF_HUB_CACHE``) holding tiny random models
and tokenizers under the repository names the tests load, the ``tests/fixtures/sample_text.txt`` file, and the
text of the Hub datasets the tests load, as JSON that ``datasets.load_dataset`` is redirected to. The tokenizers
are one byte-level BPE trained on the Zen of Python (``trl_sft_standins``) and a word-level BERT vocabulary of the
same text. The stand-ins differ from the Hub fixtures in size and vocabulary; they serve both runs equally. Not a
test module and not part of hf_dist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trl_sft_standins import REV, _tokenizer_object, zen_lines

LLAMA = "hf-internal-testing/tiny-random-LlamaForCausalLM"
BERTS = ("bert-base-uncased", "google-bert/bert-base-uncased", "bert-base-cased", "distilbert-base-uncased")
NEO = "roneneldan/TinyStories-33M"
WAV2VEC2 = "facebook/wav2vec2-base-960h"
DATASETS = ("Salesforce/wikitext", "wikitext")


def _snapshot(hub: Path, repo_id: str) -> Path:
    org, name = repo_id.split("/") if "/" in repo_id else (None, repo_id)
    repo = hub / (f"models--{org}--{name}" if org else f"models--{name}")
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REV)
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _small(model_type: str, vocab: int, **extra):
    from transformers import AutoConfig

    sizes = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return AutoConfig.for_model(model_type, **{**sizes, **extra})


def _bert_vocab(folder: Path, lower: bool) -> Path:
    words = sorted({w for line in zen_lines() for w in (line.lower() if lower else line).replace(".", " . ").split()})
    chars = sorted({c for line in zen_lines() for c in (line.lower() if lower else line)} - {" "})
    path = folder / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *chars,
                               *(f"##{c}" for c in chars)]) + "\n")
    return path


def build(root: Path) -> None:
    """Write the stand-ins under ``root`` (``root/hub``, ``root/data``)."""
    import torch
    from transformers import (
        AutoModelForCausalLM, BertForSequenceClassification, BertTokenizer, PreTrainedTokenizerFast,
        Wav2Vec2Config, Wav2Vec2FeatureExtractor,
    )

    hub = root / "hub"
    torch.manual_seed(0)
    bpe = _tokenizer_object()
    # ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>; the model's own special ids stay 0 so that a test adding
    # <|im_start|>/<|im_end|> as bos/eos sees them differ from the model config until the Trainer aligns them
    snap = _snapshot(hub, LLAMA)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(snap)
    AutoModelForCausalLM.from_config(_small("llama", bpe.get_vocab_size(), num_key_value_heads=2, bos_token_id=0,
                                            eos_token_id=0, max_position_embeddings=256)).save_pretrained(snap)
    snap = _snapshot(hub, NEO)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(snap)
    AutoModelForCausalLM.from_config(_small("gpt_neo", bpe.get_vocab_size(), num_layers=2, num_heads=4,
                                            attention_types=[[["global", "local"], 1]], bos_token_id=0,
                                            eos_token_id=0, max_position_embeddings=256)).save_pretrained(snap)
    for name in BERTS:
        snap = _snapshot(hub, name)
        tokenizer = BertTokenizer(str(_bert_vocab(snap, lower="uncased" in name)), do_lower_case="uncased" in name)
        tokenizer.save_pretrained(snap)
        config = _small("distilbert" if name.startswith("distil") else "bert", len(tokenizer))
        if name.startswith("distil"):
            config.dim, config.hidden_dim, config.n_layers, config.n_heads = 32, 64, 2, 4
        config.save_pretrained(snap)
        if name == "bert-base-cased":
            BertForSequenceClassification(config).save_pretrained(snap)
    snap = _snapshot(hub, WAV2VEC2)
    Wav2Vec2FeatureExtractor().save_pretrained(snap)
    Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        snap)
    fixtures = root / "fixtures"
    fixtures.mkdir(parents=True, exist_ok=True)
    (fixtures / "sample_text.txt").write_text("\n".join(zen_lines() * 3) + "\n")
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "text.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in zen_lines() * 3))


def install(root: Path) -> None:
    """Redirect ``datasets.load_dataset`` of the Hub text datasets the tests name to the stand-in text."""
    import datasets

    original = datasets.load_dataset

    def load_dataset(path, name=None, *args, split=None, **kwargs):
        if path in DATASETS:
            return original("json", data_files={"train": str(root / "data" / "text.jsonl")}, split=split)
        return original(path, name, *args, split=split, **kwargs)

    datasets.load_dataset = load_dataset


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(f"usage: python {sys.argv[0]} FOLDER  (writes the stand-ins there)\n\n{__doc__}")
    build(Path(sys.argv[1]))

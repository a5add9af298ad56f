"""Offline data for causal-LM fine-tuning: synthetic support transcripts, a trained chat tokenizer, tokenized
datasets with loss masking from data as users bring it (chat ``messages``, ``prompt``/``completion``, plain
``text``; a ``datasets.Dataset`` or a json/jsonl/parquet/csv/txt file), sequence packing, and Trainer evaluation
(token-weighted NLL / perplexity).

Typical use (the tiny Harbor demo)::

    from hf_dist import data
    data.write_jsonl("runs/transcripts.jsonl", n=400, seed=0)
    tok = data.train_tokenizer("runs/transcripts.jsonl", "runs/tokenizer", vocab_size=1024)
    train, eval_ = data.build_datasets("runs/transcripts.jsonl", tok, max_seq_len=256, loss_on="assistant",
                                       eval_fraction=0.1, seed=0, packed=True)
    trainer = Trainer(..., train_dataset=train, eval_dataset=eval_,
                      data_collator=data.data_collator(tok, packed=True),
                      preprocess_logits_for_metrics=data.preprocess_logits_for_metrics,
                      compute_metrics=data.compute_metrics)
"""

from hf_dist.data.demo import prepare_demo_data
from hf_dist.data.evaluation import (
    PERPLEXITY_METRIC_PATH,
    compute_metrics,
    load_perplexity_metric,
    preprocess_logits_for_metrics,
    token_nll,
)
from hf_dist.data.packing import (
    PackedCollator,
    check_model_for_packing,
    first_fit_bins,
    pack_dataset,
    packing_stats,
)
from hf_dist.data.sources import build_datasets, detect_shape, held_out_prompts, load_examples, tokenize_examples
from hf_dist.data.synthetic import LengthProfile, generate_conversations, write_jsonl
from hf_dist.data.tokenizer import special_token_ids, train_tokenizer, train_tokenizer_from_texts
from hf_dist.data.transcripts import (
    assistant_token_mask,
    data_collator,
    load_transcripts,
    read_transcripts,
    tokenize_conversation,
    tokenize_transcripts,
)

__all__ = [
    "LengthProfile",
    "PERPLEXITY_METRIC_PATH",
    "PackedCollator",
    "assistant_token_mask",
    "build_datasets",
    "check_model_for_packing",
    "compute_metrics",
    "data_collator",
    "detect_shape",
    "first_fit_bins",
    "generate_conversations",
    "held_out_prompts",
    "load_examples",
    "load_perplexity_metric",
    "load_transcripts",
    "pack_dataset",
    "packing_stats",
    "prepare_demo_data",
    "preprocess_logits_for_metrics",
    "read_transcripts",
    "special_token_ids",
    "token_nll",
    "tokenize_conversation",
    "tokenize_examples",
    "tokenize_transcripts",
    "train_tokenizer",
    "train_tokenizer_from_texts",
    "write_jsonl",
]

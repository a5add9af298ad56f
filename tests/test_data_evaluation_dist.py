"""Evaluation under 2 gloo ranks: the Trainer gathers per-example NLL sums, so eval_nll equals one process's."""

import math

import torch
from transformers import AutoTokenizer, Trainer, TrainingArguments

from dist_utils import run_distributed
from hf_dist.data import (
    build_datasets,
    compute_metrics,
    data_collator,
    prepare_demo_data,
    preprocess_logits_for_metrics,
)
from hf_dist.models import build_tiny_model


def _evaluate(jsonl, tokenizer_dir, output_dir, packed):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    _, eval_ = build_datasets(
        jsonl, tok, max_seq_len=128, loss_on="assistant", eval_fraction=0.5, seed=0, packed=packed
    )
    args = TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    trainer = Trainer(
        model=build_tiny_model(vocab_size=1024, seed=1),
        args=args,
        eval_dataset=eval_,
        data_collator=data_collator(tok, packed=packed),
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    return len(eval_), trainer.accelerator.num_processes, metrics["eval_nll"], metrics["eval_perplexity"]


def _rank_fn(rank, world_size, jsonl, tokenizer_dir, output_dir):
    return [_evaluate(jsonl, tokenizer_dir, output_dir, packed) for packed in (False, True)]


def test_eval_nll_on_two_ranks_equals_one_process(tmp_path):
    jsonl, _ = prepare_demo_data(tmp_path / "demo", n=18, seed=0, vocab_size=1024)
    tokenizer_dir = str(tmp_path / "demo" / "tokenizer")
    single = [_evaluate(str(jsonl), tokenizer_dir, str(tmp_path / "one"), packed) for packed in (False, True)]
    n_eval, processes, nll, ppl = single[0]
    assert processes == 1 and n_eval % 2 == 1  # odd: the last 2-rank batch is padded and must be de-duplicated
    # packed evaluation scores exactly the same tokens as unpacked evaluation
    torch.testing.assert_close(single[1][2], nll, rtol=1e-5, atol=1e-6)
    ranks = run_distributed(_rank_fn, 2, str(jsonl), tokenizer_dir, str(tmp_path / "two"))
    for per_rank in ranks:
        for (_, n_proc, nll_d, ppl_d), (_, _, nll_s, ppl_s) in zip(per_rank, single):
            assert n_proc == 2
            torch.testing.assert_close(nll_d, nll_s, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ppl_d, ppl_s, rtol=1e-5, atol=1e-6)
    assert math.isfinite(ppl)

"""Evaluation under 2 gloo ranks: the Trainer gathers per-example NLL sums, so eval_nll equals one process's.

The model is the parity harness's (``parity.tiny_config``: the TP sweep's non-default Llama, its vocabulary and
positions widened to the demo tokenizer's 1,024 tokens and 128-token rows; ``parity.tiny_model``, loaded from disk as
a user's), and the comparison is ``parity.assert_parity``: the evaluation metrics (``eval_nll``, ``eval_perplexity``,
unpacked then packed) as its losses, within ``atol=1e-6`` and ``rtol=1e-5``, and the weights each process evaluated
as its parameters (exactly equal). Evaluation has no gradients to compare.
"""

import math

from transformers import AutoTokenizer, Trainer, TrainingArguments

from dist_utils import run_distributed
from hf_dist.data import (
    build_datasets,
    compute_metrics,
    data_collator,
    prepare_demo_data,
    preprocess_logits_for_metrics,
)
from parity import assert_parity, tiny_config, tiny_model

DEMO_VOCAB, MAX_SEQ = 1024, 128


def _model():
    config = tiny_config("llama", "tp")
    config.vocab_size, config.max_position_embeddings = DEMO_VOCAB, MAX_SEQ
    return tiny_model(config, seed=1, loaded=True)


def _evaluate(jsonl, tokenizer_dir, output_dir, packed):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    _, eval_ = build_datasets(
        jsonl, tok, max_seq_len=MAX_SEQ, loss_on="assistant", eval_fraction=0.5, seed=0, packed=packed
    )
    args = TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=2, report_to=[], use_cpu=True)
    trainer = Trainer(
        model=_model(),
        args=args,
        eval_dataset=eval_,
        data_collator=data_collator(tok, packed=packed),
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return len(eval_), trainer.accelerator.num_processes, [metrics["eval_nll"], metrics["eval_perplexity"]], state


def _runs(jsonl, tokenizer_dir, output_dir) -> dict:
    """Unpacked and packed evaluation in ``assert_parity``'s shape; the eval set size and process count."""
    (n_eval, processes, unpacked, state), (_, _, packed, _) = (
        _evaluate(jsonl, tokenizer_dir, output_dir, packed) for packed in (False, True))
    return {"losses": unpacked + packed, "state": state, "n_eval": n_eval, "processes": processes}


def _rank_fn(rank, world_size, jsonl, tokenizer_dir, output_dir):
    return _runs(jsonl, tokenizer_dir, output_dir)


def test_eval_nll_on_two_ranks_equals_one_process(tmp_path):
    jsonl, _ = prepare_demo_data(tmp_path / "demo", n=18, seed=0, vocab_size=DEMO_VOCAB)
    tokenizer_dir = str(tmp_path / "demo" / "tokenizer")
    single = _runs(str(jsonl), tokenizer_dir, str(tmp_path / "one"))
    assert single["processes"] == 1 and single["n_eval"] % 2 == 1  # odd: the last 2-rank batch is padded, de-duplicated
    nll, ppl, packed_nll, _ = single["losses"]
    # packed evaluation scores exactly the same tokens as unpacked evaluation
    assert_parity({**single, "losses": [packed_nll]}, {**single, "losses": [nll]}, atol=1e-6, rtol=1e-5,
                  state_atol=0, what="packed vs unpacked")
    assert math.isfinite(ppl) and abs(math.log(ppl) - nll) < 1e-4  # the perplexity is the NLL's, not another number
    for rank, got in enumerate(run_distributed(_rank_fn, 2, str(jsonl), tokenizer_dir, str(tmp_path / "two"))):
        assert got["processes"] == 2
        assert_parity(got, single, atol=1e-6, rtol=1e-5, state_atol=0, what=f"rank {rank}, 2 ranks vs one process")

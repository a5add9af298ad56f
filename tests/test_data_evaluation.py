"""Token-weighted NLL / perplexity: hand computations, the shipped evaluate module, and the HF Trainer path."""

import math

import numpy as np
import pytest
import torch
from transformers import EvalPrediction, Trainer, TrainingArguments

from hf_dist.data import (
    PERPLEXITY_METRIC_PATH,
    build_datasets,
    compute_metrics,
    data_collator,
    load_perplexity_metric,
    prepare_demo_data,
    preprocess_logits_for_metrics,
    token_nll,
)
from hf_dist.models import build_tiny_model


def _hand_nll(logits, labels):
    """Per example sum of -log p(label[t+1] | logits[t]) over labels != -100, by explicit loops in float64."""
    sums, counts = [], []
    for b in range(logits.shape[0]):
        total, count = 0.0, 0
        for t in range(logits.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == -100:
                continue
            log_probs = torch.log_softmax(logits[b, t].double(), dim=-1)
            total -= float(log_probs[target])
            count += 1
        sums.append(total)
        counts.append(count)
    return torch.tensor(sums, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)


def test_token_nll_matches_a_hand_computation_with_the_causal_shift():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, :3] = -100
    labels[2, 5:] = -100
    sums, counts = token_nll(logits, labels)
    hand_sums, hand_counts = _hand_nll(logits, labels)
    torch.testing.assert_close(sums.double(), hand_sums, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(counts.double(), hand_counts)
    assert counts.tolist() == [4.0, 6.0, 4.0]  # labels[:, 0] is never scored
    packed = preprocess_logits_for_metrics((logits,), labels)
    assert packed.shape == (3, 2)
    torch.testing.assert_close(packed[:, 0], sums)


def test_compute_metrics_pools_by_tokens_not_by_examples():
    predictions = np.array([[10.0, 5.0], [2.0, 1.0], [30.0, 10.0]])
    result = compute_metrics(EvalPrediction(predictions=predictions, label_ids=np.zeros((3, 4))))
    nll = 42.0 / 16.0
    assert set(result) == {"perplexity", "nll"}
    torch.testing.assert_close(result["nll"], nll)
    torch.testing.assert_close(result["perplexity"], math.exp(nll))
    with pytest.raises(ValueError, match=r"shape \(3,\), expected \(examples, 2\)"):
        compute_metrics(EvalPrediction(predictions=np.ones(3), label_ids=np.zeros(3)))


def test_the_shipped_module_loads_offline_and_refuses_zero_tokens():
    assert PERPLEXITY_METRIC_PATH.is_file()
    metric = load_perplexity_metric()
    out = metric.compute(nll_sums=[1.5, 0.5], token_counts=[1, 3])
    assert out["tokens"] == 4
    torch.testing.assert_close(out["nll"], 0.5)
    with pytest.raises(ValueError, match="perplexity is undefined"):
        metric.compute(nll_sums=[0.0], token_counts=[0])


def test_trainer_evaluate_reports_the_token_weighted_nll(tmp_path):
    jsonl, tok = prepare_demo_data(tmp_path / "demo", n=16, seed=0, vocab_size=1024)
    _, eval_ = build_datasets(jsonl, tok, max_seq_len=128, loss_on="assistant", eval_fraction=0.5, seed=0)
    model = build_tiny_model(vocab_size=1024, seed=1)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_eval_batch_size=3, report_to=[], use_cpu=True
    )
    trainer = Trainer(
        model=model,
        args=args,
        eval_dataset=eval_,
        data_collator=data_collator(tok),
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    # Reference: the model's own mean loss over ALL eval examples in one padded batch is token-weighted.
    batch = data_collator(tok)([eval_[i] for i in range(len(eval_))])
    with torch.no_grad():
        reference = model.eval()(**batch, use_cache=False).loss.item()
    assert len(eval_) > 3  # several eval batches of different widths: a mean of batch means would differ
    torch.testing.assert_close(metrics["eval_nll"], reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["eval_perplexity"], math.exp(reference), rtol=1e-5, atol=1e-6)


def test_trainer_evaluate_with_moe_router_outputs(tmp_path):
    """A MoE model with ``output_router_logits=True`` hands the Trainer ``(aux_loss, logits, router_logits)``:
    the metric must score the logits (it once took the scalar aux loss and raised)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    jsonl, tok = prepare_demo_data(tmp_path / "demo", n=16, seed=0, vocab_size=1024)
    _, eval_ = build_datasets(jsonl, tok, max_seq_len=128, loss_on="assistant", eval_fraction=0.5, seed=0)
    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.3, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=3, report_to=[], use_cpu=True)
    trainer = Trainer(
        model=model, args=args, eval_dataset=eval_, data_collator=data_collator(tok),
        preprocess_logits_for_metrics=preprocess_logits_for_metrics, compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    batch = data_collator(tok)([eval_[i] for i in range(len(eval_))])
    with torch.no_grad():  # the language-model loss alone: the aux term is not a token NLL
        reference = model.eval()(**batch, use_cache=False, output_router_logits=False).loss.item()
    torch.testing.assert_close(metrics["eval_nll"], reference, rtol=1e-5, atol=1e-6)


def test_lm_logits_refuses_outputs_without_logits():
    from hf_dist.data.evaluation import lm_logits

    labels = torch.zeros(2, 5, dtype=torch.long)
    logits = torch.randn(2, 5, 7)
    assert lm_logits((torch.tensor(1.0), logits, (torch.randn(10, 4),)), labels) is logits
    with pytest.raises(ValueError, match=r"no model output has the shape \(batch, seq, vocab\)"):
        lm_logits((torch.tensor(1.0), torch.randn(10, 4)), labels)

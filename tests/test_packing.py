"""Sequence packing: the bin packer, the collator, and loss/gradient equality with unpacked batches."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_dist.data import (
    PackedCollator,
    check_model_for_packing,
    build_datasets,
    data_collator,
    first_fit_bins,
    pack_dataset,
    prepare_demo_data,
)
from hf_dist.data.packing import pack_rows
from hf_dist.models import build_tiny_model

SEQ = 128


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """10 tokenized conversations (loss on assistant turns) and the tokenizer."""
    jsonl, tok = prepare_demo_data(tmp_path_factory.mktemp("pack"), n=24, seed=0, vocab_size=1024)
    train, _ = build_datasets(jsonl, tok, max_seq_len=SEQ, loss_on="assistant", eval_fraction=0.0, seed=0)
    return train.select(range(10)), tok


def test_first_fit_bins_places_every_item_once_within_capacity():
    lengths = [5, 9, 3, 7, 2, 10, 1, 4, 8, 6]
    bins = first_fit_bins(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert all(b == sorted(b) for b in bins)  # dataset order is kept inside a row
    assert len(bins) == 6  # first fit: [5,3,2], [9,1], [7], [10], [4,6], [8]
    capped = first_fit_bins(lengths, 10, max_open_bins=1)
    assert sorted(i for b in capped for i in b) == list(range(len(lengths)))
    assert len(capped) >= len(bins)
    with pytest.raises(ValueError, match="item 1 has 9 tokens, outside \\[1, 8\\]"):
        first_fit_bins([3, 9], 8)


def test_pack_rows_restarts_positions_and_hides_each_first_label():
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}]
    packed = pack_rows(rows)
    assert packed == {
        "input_ids": [1, 2, 3, 4, 5],
        "labels": [-100, 2, 3, -100, 5],
        "position_ids": [0, 1, 2, 0, 1],
    }


def test_packed_collator_pads_each_row_as_a_separate_sequence():
    rows = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4], "position_ids": [0, 1, 0, 1]},
        {"input_ids": [5, 6], "labels": [-100, 6], "position_ids": [0, 1]},
    ]
    batch = PackedCollator(pad_token_id=0, pad_to_multiple_of=3)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: see the module docstring
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 0, 0], [5, 6, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3, 4, -100, -100], [-100, 6, -100, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="a packed row has 4 tokens but pad_to=3"):
        PackedCollator(pad_token_id=0, pad_to=3)(rows)


def _batches(sub, tok):
    packed_ds = pack_dataset(sub, max_seq_len=SEQ)
    assert len(packed_ds) < len(sub)  # something was really packed
    unpacked = data_collator(tok)([sub[i] for i in range(len(sub))])
    packed = data_collator(tok, packed=True, pad_to=SEQ)([packed_ds[i] for i in range(len(packed_ds))])
    return unpacked, packed, packed_ds


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked_token_weighted_loss(conversations, attn):
    sub, tok = conversations
    unpacked, packed, _ = _batches(sub, tok)
    model = build_tiny_model(vocab_size=1024).eval()
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    with torch.no_grad():
        loss_unpacked = model(**unpacked, use_cache=False).loss
        loss_packed = model(**packed, use_cache=False).loss
        # Control: the same packed rows with plain causal attention (no position reset) leak across
        # conversations, so the comparison above can fail.
        leaky = model(input_ids=packed["input_ids"], labels=packed["labels"], use_cache=False).loss
    torch.testing.assert_close(loss_packed, loss_unpacked)
    assert abs(leaky.item() - loss_unpacked.item()) > 1e-5


def test_packed_logits_equal_each_conversation_alone(conversations):
    sub, tok = conversations
    _, packed, packed_ds = _batches(sub, tok)
    model = build_tiny_model(vocab_size=1024).eval()
    with torch.no_grad():
        logits = model(**packed, use_cache=False).logits
        for row, positions in enumerate(packed_ds["position_ids"]):
            starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
            for start, end in zip(starts, starts[1:]):
                alone = model(input_ids=packed["input_ids"][row : row + 1, start:end], use_cache=False).logits
                torch.testing.assert_close(logits[row : row + 1, start:end], alone, rtol=1e-4, atol=1e-5)


def _one_sgd_step(dataset, collator, output_dir):
    model = build_tiny_model(vocab_size=1024, seed=3)
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(dataset),
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    loss = trainer.train().training_loss
    return loss, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trainer_step_on_packed_rows_equals_unpacked(conversations, tmp_path):
    """Through the HF Trainer (which turns the KV cache off): same loss and same weights after one step."""
    sub, tok = conversations
    packed_ds = pack_dataset(sub, max_seq_len=SEQ)
    loss_u, params_u = _one_sgd_step(sub, data_collator(tok), tmp_path / "u")
    loss_p, params_p = _one_sgd_step(packed_ds, data_collator(tok, packed=True), tmp_path / "p")
    torch.testing.assert_close(loss_p, loss_u, rtol=1.3e-6, atol=1e-5)  # float32 tolerances for Python floats
    reference = build_tiny_model(vocab_size=1024, seed=3)
    moved = max((params_u[n] - p).abs().max().item() for n, p in reference.named_parameters())
    assert moved > 1e-4  # the step changed the weights, so equal weights mean equal gradients
    for name, tensor in params_u.items():
        torch.testing.assert_close(params_p[name], tensor, msg=lambda m, n=name: f"{n}: {m}")


def test_flash_attention_gets_varlen_boundaries_over_the_flattened_batch(conversations):
    """transformers infers flash varlen boundaries from position_ids only for ONE row; the collator gives them."""
    rows = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4], "position_ids": [0, 1, 2, 0]},
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]},
    ]
    batch = PackedCollator(pad_token_id=0, pad_to=5, flash_attn_kwargs=True)(rows)
    # row 0: [0,1,2] [0] [pad 0]; row 1: [0,1,2] [pad 0,1]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 5, 8, 10]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    sub, tok = conversations
    assert "cu_seq_lens_q" in data_collator(tok, packed=True, attn_implementation="flash_attention_2")(rows)
    assert "cu_seq_lens_q" not in data_collator(tok, packed=True, attn_implementation="sdpa")(rows)
    # sdpa ignores the extra kwargs: the loss is unchanged.
    unpacked, packed, packed_ds = _batches(sub, tok)
    with_kwargs = data_collator(tok, packed=True, pad_to=SEQ, attn_implementation="flash_attention_2")(
        [packed_ds[i] for i in range(len(packed_ds))]
    )
    model = build_tiny_model(vocab_size=1024).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**with_kwargs, use_cache=False).loss, model(**packed, use_cache=False).loss)


def test_models_that_would_leak_across_conversations_are_refused(conversations):
    sub, tok = conversations
    model = build_tiny_model(vocab_size=1024)
    collator = data_collator(tok, packed=True)
    assert model.config.use_cache  # the default of a fresh config
    with pytest.raises(ValueError, match="use_cache=True: .*set model.config.use_cache=False"):
        check_model_for_packing(model, collator)
    model.config.use_cache = False
    check_model_for_packing(model, collator)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' needs varlen boundaries"):
        check_model_for_packing(model, collator)
    check_model_for_packing(model, data_collator(tok, packed=True, attn_implementation="flash_attention_2"))
    # What the check prevents: with a KV cache, the packed loss is no longer the unpacked one.
    model.config._attn_implementation = "sdpa"
    unpacked, packed, _ = _batches(sub, tok)
    with torch.no_grad():
        leaky = model.eval()(**packed, use_cache=True).loss
        exact = model(**unpacked, use_cache=False).loss
    assert abs(leaky.item() - exact.item()) > 1e-5

"""PP with batches whose length changes every step, through the recipe's real collator, against one process.

The collator (``hf_dist.data.data_collator``: transformers' ``DataCollatorForSeq2Seq``) pads each batch to its
longest row, so every step has another length. ``PipelinedCausalLM`` right-pads each batch to a multiple of
``PipelineConfig.pad_to_multiple_of`` and keeps one schedule per padded length; losses, gradient norms and
weights (plain SGD, clipping active: ``parity.PP_SGD``) must equal a single-process Trainer's on the unpadded
batches (``parity.assert_parity``). The model is the harness's case (``tiny_config("llama:gqa", "pp")``) with the
tokenizer's vocabulary, loaded from disk as users load theirs.
"""

from __future__ import annotations

import copy

from dist_utils import run_distributed
from parity import PP_SGD, assert_parity, tiny_config, tiny_model

STEPS, GLOBAL_BATCH, MICRO = 4, 4, 1


def _data(tmp: str):
    from hf_dist.data import data_collator, generate_conversations, tokenize_conversation, train_tokenizer_from_texts

    conversations = generate_conversations(STEPS * GLOBAL_BATCH, seed=3)
    texts = [turn["content"] for c in conversations for turn in c["messages"]]
    tokenizer = train_tokenizer_from_texts(texts, tmp, vocab_size=300)
    # rows of different lengths; each step's longest row is 20 tokens longer than the last step's (30..90), so
    # padded batches cross the 64-token bucket: both one and two schedules' worth of shapes are exercised
    limits = [30 + 20 * (i // GLOBAL_BATCH) - 3 * (i % GLOBAL_BATCH) for i in range(len(conversations))]
    rows = [tokenize_conversation(tokenizer, c["messages"], max_seq_len=n) for c, n in zip(conversations, limits)]
    return tokenizer, rows, data_collator(tokenizer)


def _model(vocab: int):
    config = copy.deepcopy(tiny_config("llama:gqa", "pp"))
    config.vocab_size = vocab
    return tiny_model(config, loaded=True)


def _args(output_dir: str, **extra):
    return dict(
        output_dir=output_dir, max_steps=STEPS, learning_rate=PP_SGD.lr, optim="sgd", lr_scheduler_type="constant",
        max_grad_norm=PP_SGD.max_norm,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], seed=0, disable_tqdm=True,
        dataloader_num_workers=0, train_sampling_strategy="sequential", **extra,
    )


def _train(rank, world_size, tmp, pp):
    from transformers import Trainer, TrainingArguments

    from hf_dist import DistTrainer, DistTrainingArguments

    tokenizer, rows, collator = _data(f"{tmp}/tok")
    if pp:
        args = DistTrainingArguments(**_args(f"{tmp}/pp"), per_device_train_batch_size=MICRO,
                                     global_batch_size=GLOBAL_BATCH, pp_size=2)
        trainer = DistTrainer(model=_model(len(tokenizer)), args=args, train_dataset=rows, data_collator=collator)
    else:
        args = TrainingArguments(**_args(f"{tmp}/ref"), per_device_train_batch_size=GLOBAL_BATCH, use_cpu=True)
        trainer = Trainer(model=_model(len(tokenizer)), args=args, train_dataset=rows, data_collator=collator)
    lengths = [collator(rows[i : i + GLOBAL_BATCH])["input_ids"].shape[1] for i in range(0, len(rows), GLOBAL_BATCH)]
    trainer.train()
    history = {key: [log[key] for log in trainer.state.log_history if "grad_norm" in log]
               for key in ("loss", "grad_norm")}
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return lengths, history, weights


def test_varying_lengths_train_like_one_process(tmp_path):
    results = run_distributed(_train, 2, str(tmp_path), True)
    lengths, ref_history, ref_weights = _train(0, 1, str(tmp_path), False)
    assert lengths == [30, 50, 70, 90], lengths  # every step another length
    # the first step's 30-token rows are all prompt (no label token: loss 0, no gradient, as in one process); clipping
    # is active on every other step, so the norm over both stages matters
    norms = ref_history["grad_norm"]
    assert norms[0] == 0.0 and min(norms[1:]) > PP_SGD.max_norm, norms
    ref = {"losses": ref_history["loss"], "norms": ref_history["grad_norm"], "state": ref_weights}
    weights = {**results[0][2], **results[1][2]}  # each rank holds its stages' weights under HF names
    for rank, (rank_lengths, history, _) in enumerate(results):
        assert rank_lengths == lengths
        # the Trainer rounds logged losses (4 significant digits); the weights to 1e-5
        assert_parity({"losses": history["loss"], "norms": history["grad_norm"], "state": weights}, ref, atol=1e-4,
                      state_atol=1e-5, what=f"rank {rank}")

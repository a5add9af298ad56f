"""Greedy chat answers: what the demo, the notebook and the tests print and compare before and after training.

Works on a model in memory under one process, DDP, DeepSpeed, FSDP2 (``hf_dist.parallelism`` makes ``generate``
gather the root's weights, a ``PeftModel`` included) and TP; every rank of a sharded model must call it with the
same messages. A pipeline-parallel model has no ``generate`` and is refused. Not a serving path: one conversation
at a time, no sampling, no batching.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_answer(model, tokenizer, messages: list[dict] | str, *, max_new_tokens: int = 32, chat: bool = True) -> str:
    """The model's greedy reply to ``messages`` (a chat, or one user message as a string), rendered with the
    tokenizer's chat template; special tokens are stripped from the reply. ``chat=False``: ``messages`` is plain
    text, tokenized as it is and continued (what a model trained on ``prompt`` / ``completion`` strings or on
    ``text`` learned to do, ``hf_dist.data.held_out_prompts``)."""
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"{type(model).__name__} has no generate(): a pipeline-parallel model (pp_size > 1) holds only its own "
            f"stages on each rank and cannot answer in memory; reload the saved model with from_pretrained to answer, "
            f"or use a layout without pipeline parallelism (FSDP2, TP, DDP, DeepSpeed)"
        )
    if not chat:
        if not isinstance(messages, str):
            raise ValueError(f"chat=False takes plain text, not {type(messages).__name__}; pass a string, or "
                             f"chat=True for a list of messages")
        encoded = tokenizer(messages, return_tensors="pt")
        inputs = {name: encoded[name] for name in ("input_ids", "attention_mask") if name in encoded}
    else:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()

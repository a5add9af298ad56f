"""The planner's model-state bytes equal what DDP, FSDP2 and TP=2 ranks really hold (2 gloo ranks, tiny model).

Under TP the lm_head is split on the vocabulary when untied and the vocabulary divides by tp, and whole
otherwise; the embedding only under vocab parallelism (a tied weight then split once, with the embedding).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from hf_dist.planner import Workload, make_layout, model_spec
from hf_dist.planner.measure import model_state_bytes
from hf_dist.planner.activations import activation_model
from hf_dist.planner.states import model_states

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def _states_after_one_step(rank: int, world: int, strategy: str) -> dict[str, int]:
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    model = build_tiny_model(tiny_llama_config(**TINY))
    if strategy == "fsdp_full_shard":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model_state_bytes(model, optimizer)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp_full_shard"])
def test_predicted_model_states_equal_measured_on_two_ranks(strategy):
    from hf_dist.models.tiny import tiny_llama_config

    measured = run_distributed(_states_after_one_step, 2, strategy)
    spec = model_spec(tiny_llama_config(**TINY))
    predicted = model_states(spec, Workload(seq_len=16, micro_batch_size=2, precision="fp32"),
                             make_layout(strategy, 2), layers=spec.num_hidden_layers)
    for rank_states in measured:  # dims are even, so both ranks hold the same
        assert rank_states == {"parameters": predicted.parameters, "gradients": predicted.gradients,
                               "optimizer_states": predicted.optimizer_states}
    if strategy == "fsdp_full_shard":
        assert predicted.parameters * 2 == 4 * spec.num_params


# (tie_word_embeddings, vocab_parallel, vocab_size): the head split, a tied head whole, an odd vocabulary (head
# whole), vocab parallelism untied and tied
TP_CASES = ((False, False, 256), (True, False, 256), (False, False, 255), (False, True, 256), (True, True, 256))


def _tp_states(rank: int, world: int) -> list[dict[str, int]]:
    from hf_dist import ParallelDims, parallelize
    from hf_dist.models.tiny import build_tiny_model, tiny_llama_config

    out = []
    for tie, vocab_parallel, vocab in TP_CASES:
        model = build_tiny_model(tiny_llama_config(**{**TINY, "vocab_size": vocab, "tie_word_embeddings": tie}))
        dims = ParallelDims(world_size=world, tp=world, dp_shard=1)
        dims.build_mesh("cpu")
        parallelize(model, dims, vocab_parallel=vocab_parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, vocab, (2, 16))
        output = model(input_ids=ids, labels=ids)
        output.loss.backward()
        optimizer.step()
        logits = getattr(output.logits, "_local_tensor", output.logits)
        out.append({**model_state_bytes(model, optimizer), "logits": logits.numel() * logits.element_size()})
    return out


def test_predicted_model_states_equal_measured_under_tp():
    from hf_dist.models.tiny import tiny_llama_config

    measured = run_distributed(_tp_states, 2)
    for i, (tie, vocab_parallel, vocab) in enumerate(TP_CASES):
        spec = model_spec(tiny_llama_config(**{**TINY, "vocab_size": vocab, "tie_word_embeddings": tie}))
        layout = make_layout("ddp", 2, tp=2, vocab_parallel=vocab_parallel)
        predicted = model_states(spec, Workload(seq_len=16, micro_batch_size=2, precision="fp32"), layout,
                                 layers=spec.num_hidden_layers)
        logits = activation_model(spec, Workload(seq_len=16, micro_batch_size=2, precision="fp32"), layout)
        for rank_states in measured:  # logits: the fp32 N x V (vocab parallel: N x V/tp) the loss reads
            assert rank_states[i] == {"parameters": predicted.parameters, "gradients": predicted.gradients,
                                      "optimizer_states": predicted.optimizer_states,
                                      "logits": logits.logits_forward}, (tie, vocab_parallel, vocab)

"""The planner's model-state bytes equal what DDP and FSDP2 ranks really hold (2 gloo ranks, tiny model)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from hf_dist.planner import Workload, make_layout, model_spec
from hf_dist.planner.measure import model_state_bytes
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

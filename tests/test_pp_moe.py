"""PP=2 for mixture-of-experts models: 2 gloo ranks (1F1B, 4 micro-batches) train 3 AdamW steps equal to one
process accumulating the same micro-batches with loss ``token-mean LM + coef x mean(aux)``.

The router aux coefficient is 5.0 so its gradient dominates the routers: the test also checks that the first
stage's router weights move differently without the aux term, so a stage whose aux gradient were dropped
(Megatron's problem for non-final stages; here the router statistics travel with the hidden states and the
aux gradient comes back through them) would fail the comparison.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dist_utils import run_distributed
from hf_dist.models.reference import reference_step, split_rows
from pp_sweep_cases import MOE, SEQ, moe_config

STEPS, BATCH, MICROBATCHES, LR = 3, 4, 4, 1e-3


def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        lengths = torch.tensor([SEQ, SEQ - 5, SEQ // 2, SEQ - 1])
        mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def reference(config, steps, aux: bool = True):
    """One process: the step's micro-batches accumulated, aux weighted coef x mean over them (the model's own;
    ``hf_dist.models.reference``, the layout canary's reference too)."""
    model = _model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in steps:
        total = reference_step(model, split_rows(batch, MICROBATCHES), aux=aux)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pipelined(rank, world_size, cases):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM, gather_state_dict

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    results = {}
    for case in cases:
        config = moe_config(case)
        pipe = PipelinedCausalLM(_model(config), dims=dims,
                                 config=PipelineConfig(schedule="1f1b", microbatches=MICROBATCHES))
        optimizer = torch.optim.AdamW(list(pipe.parameters()), lr=LR)
        losses = []
        for batch in _batches(config.vocab_size):
            losses.append(float(pipe.train_step(batch)))
            optimizer.step()
            optimizer.zero_grad()
        state = gather_state_dict(pipe)
        results[case] = (losses, state if rank == 0 else None, pipe.plan.stages)
    return results


@pytest.fixture(scope="module")
def pipelined():
    return run_distributed(_pipelined, 2, sorted(MOE), timeout_s=900)[0]


@pytest.mark.parametrize("case", sorted(MOE))
def test_pp2_moe_matches_one_process(pipelined, case):
    config = moe_config(case)
    steps = _batches(config.vocab_size)
    losses, state, stages = pipelined[case]
    ref_losses, ref_state = reference(config, steps)
    assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=key)
    if getattr(config, "output_router_logits", False):  # the aux gradient of the FIRST stage's routers matters
        first = [k for k in ref_state if k.startswith("model.layers.0.") and k.endswith(("gate.weight", "router.weight"))]
        _, no_aux = reference(config, steps, aux=False)
        assert first and max(float((no_aux[k] - ref_state[k]).abs().max()) for k in first) > 1e-3
        assert "model.layers.0" in stages[0]

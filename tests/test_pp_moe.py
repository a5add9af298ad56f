"""PP=2 for mixture-of-experts models: 2 gloo ranks (1F1B, 4 micro-batches) train 3 steps equal to one process
accumulating the same micro-batches with loss ``token-mean LM + coef x mean(aux)``, through the parity harness
(``parity.pipelined_run`` against ``parity.reference_run``, ``parity.assert_parity`` at 1e-5): losses and gradient
norms on both ranks, the first step's gradients (each rank's stages), every parameter after the steps, router and
expert weights required. Plain SGD with clipping active on every step (``parity.PP_SGD``): parameters compare
gradients, and the norm across both stages matters.

The router aux coefficient is 5.0 so its gradient dominates the routers: the test also checks that the first
stage's router weights move differently without the aux term, so a stage whose aux gradient were dropped
(Megatron's problem for non-final stages; here the router statistics travel with the hidden states and the
aux gradient comes back through them) would fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from parity import PP_SGD, assert_parity, masked_batches, pipelined_run, reference_run, split_rows, tiny_config, tiny_model
from pp_sweep_cases import MOE, SEQ

STEPS, MICROBATCHES = 3, 4


def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    return masked_batches(vocab, SEQ, STEPS)


def reference(config, steps, aux: bool = True) -> dict:
    """One process (the parity harness's reference, the layout canary's too): the step's micro-batches accumulated,
    aux weighted coef x mean over them (the model's own); the first step's gradients."""
    return reference_run(tiny_model(config), [split_rows(batch, MICROBATCHES) for batch in steps], PP_SGD, aux=aux,
                         grads=True)


def _pipelined(rank, world_size, cases):
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel import PipelineConfig, PipelinedCausalLM

    dims = ParallelDims(world_size=2, pp=2, dp_shard=1)
    dims.build_mesh("cpu")
    results = {}
    for case in cases:
        config = tiny_config(case, "pp")
        pipe = PipelinedCausalLM(tiny_model(config), dims=dims,
                                 config=PipelineConfig(schedule="1f1b", microbatches=MICROBATCHES))
        results[case] = (pipelined_run(pipe, _batches(config.vocab_size), PP_SGD, grads=True), pipe.plan.stages)
    return results


@pytest.fixture(scope="module")
def pipelined():
    return run_distributed(_pipelined, 2, sorted(MOE), timeout_s=900)


@pytest.mark.parametrize("case", sorted(MOE))
def test_pp2_moe_matches_one_process(pipelined, case):
    config = tiny_config(case, "pp")
    steps = _batches(config.vocab_size)
    ref = reference(config, steps)
    assert min(ref["norms"]) > PP_SGD.max_norm, ref["norms"]  # clipping active on every step
    runs = [by_case[case][0] for by_case in pipelined]
    grads = {name: grad for run in runs for name, grad in run["grads"].items()}  # each rank's stages
    assert runs[1]["state"] is None
    for rank, run in enumerate(runs):
        assert_parity({**run, "grads": grads, "state": runs[0]["state"]}, ref, config=config,
                      what=f"{case} rank {rank}")
    stages = pipelined[0][case][1]
    if getattr(config, "output_router_logits", False):  # the aux gradient of the FIRST stage's routers matters
        ref_state = ref["state"]
        first = [k for k in ref_state if k.startswith("model.layers.0.") and k.endswith(("gate.weight", "router.weight"))]
        no_aux = reference(config, steps, aux=False)["state"]
        assert first and max(float((no_aux[k] - ref_state[k]).abs().max()) for k in first) > 1e-3
        assert "model.layers.0" in stages[0]

"""LoRA + TP: every TP rank ends with the same adapter, equal to one process, and the saved adapter loads with PEFT
onto a plain model and gives the same logits.

The base models are the parity harness's TP cases (``parity.tiny_config(case, "tp")``: llama, and phi3 whose fused
q/k/v and gate/up have lora_B split part by part; a sliding window under the sequence where the type has one), loaded
from disk as users load theirs. Each rank starts from a different adapter (TP must make them agree); the one process
(``reference_run``) starts from rank 0's. 5 plain SGD steps with clipping active on fresh padded rows every step
(``masked_batches``), compared by ``assert_parity``: losses, gradient norms, the first step's adapter gradients and
every weight after the steps within 1e-5. One 2-rank spawn runs both cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed
from parity import TP_SGD, assert_parity, layout_run, masked_batches, reference_run, tiny_config, tiny_model
from tp_sweep_cases import SEQ

STEPS = 5
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused: lora_B is split part by part
}


def base_model(case: str):
    return tiny_model(tiny_config(case, "tp"), loaded=True)


def lora_model(case: str, seed: int):
    from peft import LoraConfig, get_peft_model

    base = base_model(case)
    torch.manual_seed(seed)  # the adapter's own initialisation
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[case], init_lora_weights="gaussian"
    )
    return get_peft_model(base, config)


def batches(case: str) -> list[dict[str, torch.Tensor]]:
    return masked_batches(tiny_config(case, "tp").vocab_size, SEQ, STEPS)


def adapter(state: dict) -> dict:
    return {k: v for k, v in state.items() if "lora_" in k}


def lora_case(case: str, rank: int, tp_mesh, save_dir: str) -> dict:
    from hf_dist.state_dict import save_gathered
    from hf_dist.tensor_parallel import apply_tensor_parallel

    model = lora_model(case, seed=100 + rank)  # each rank starts from a different adapter: TP must make them agree
    apply_tensor_parallel(model, tp_mesh)
    run = layout_run(model, batches(case), TP_SGD, grads=True)
    save_gathered(model, save_dir)
    with torch.no_grad():
        logits = model(input_ids=batches(case)[0]["input_ids"]).logits
    dist.barrier()
    return {"run": run, "logits": logits}


def _lora_tp(rank, world_size, save_dir):
    from hf_dist import ParallelDims

    dims = ParallelDims(world_size=world_size, tp=world_size, dp_shard=1)
    dims.build_mesh("cpu")
    return {case: lora_case(case, rank, dims.get_mesh("tp"), f"{save_dir}/{case}") for case in TARGETS}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_tp")


@pytest.fixture(scope="module")
def all_ranks(saved) -> list[dict]:
    """One 2-rank run shared by the tests below."""
    return run_distributed(_lora_tp, 2, str(saved))


@pytest.mark.parametrize("case", list(TARGETS))
def test_lora_adapter_identical_on_tp_ranks_and_matches_one_process(all_ranks, case):
    ranks = [by_case[case]["run"] for by_case in all_ranks]
    first = adapter(ranks[0]["state"])
    assert len(first) == 2 * len(TARGETS[case]) * 2  # A and B, every target, 2 layers
    for other in ranks[1:]:
        for key, value in adapter(other["state"]).items():
            assert torch.equal(value, first[key]), f"{key} differs between TP ranks"
    ref = reference_run(lora_model(case, seed=100), [[batch] for batch in batches(case)], TP_SGD, grads=True)
    assert min(ref["norms"]) > TP_SGD.max_norm  # clipping active
    assert sorted(ref["grads"]) == sorted(k for k in ref["state"] if "lora_" in k)  # only the adapter trains
    for rank, run in enumerate(ranks):
        assert_parity(run, ref, what=f"rank {rank} {case}")


@pytest.mark.parametrize("case", list(TARGETS))
def test_saved_adapter_loads_on_plain_model_with_same_logits(all_ranks, saved, case):
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(base_model(case), str(saved / case))
    with torch.no_grad():
        want = loaded(input_ids=batches(case)[0]["input_ids"]).logits
    for by_case in all_ranks:
        assert_close(by_case[case]["logits"], want, atol=1e-5, rtol=0)

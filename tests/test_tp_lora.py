"""LoRA + TP: every TP rank ends with the same adapter, equal to single-process training, and the saved
adapter loads with PEFT onto a plain model and gives the same logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed
from test_tp_parity import STEPS, build, global_batch, to_numpy, train

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # fused: lora_B is split part by part
}


def lora_model(arch: str, seed: int):
    from peft import LoraConfig, get_peft_model

    base = build(arch)
    torch.manual_seed(seed)  # the adapter's own initialisation
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[arch], init_lora_weights="gaussian"
    )
    return get_peft_model(base, config)


def adapter(state: dict) -> dict:
    return {k: v for k, v in state.items() if "lora_" in k}


def _lora_case(arch: str, rank: int, dims, save_dir: str) -> dict:
    from peft import PeftModel

    from hf_dist.state_dict import full_state_dict, save_gathered
    from hf_dist.tensor_parallel import apply_tensor_parallel

    batch = global_batch()
    model = lora_model(arch, seed=100 + rank)  # each rank starts from a different adapter: TP must make them agree
    apply_tensor_parallel(model, dims.get_mesh("tp"))
    losses, _ = train(model, batch, STEPS, distributed=True)
    trained = adapter(full_state_dict(model))
    save_gathered(model, save_dir)
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    out = {"adapter": trained, "losses": losses, "logits": logits}
    if rank == 0:
        reference = lora_model(arch, seed=100)  # rank 0's initial adapter, trained in one process
        out["ref_losses"], _ = train(reference, batch, STEPS)
        out["ref_adapter"] = adapter({k: v.detach() for k, v in reference.state_dict().items()})
        loaded = PeftModel.from_pretrained(build(arch), save_dir)
        with torch.no_grad():
            out["loaded_logits"] = loaded(input_ids=batch).logits
    dist.barrier()
    return to_numpy(out)


def _lora_tp(rank, world_size, save_dir):
    from hf_dist import ParallelDims

    dims = ParallelDims(world_size=world_size, tp=world_size, dp_shard=1)
    dims.build_mesh("cpu")
    return {arch: _lora_case(arch, rank, dims, f"{save_dir}/{arch}") for arch in TARGETS}


@pytest.fixture(scope="module")
def all_ranks(tmp_path_factory) -> list[dict]:
    """One 2-rank run shared by the tests below."""
    return run_distributed(_lora_tp, 2, str(tmp_path_factory.mktemp("lora_tp")))


def _as_tensors(tree: dict) -> dict:
    return {k: torch.as_tensor(v) for k, v in tree.items()}


@pytest.mark.parametrize("arch", list(TARGETS))
def test_lora_adapter_identical_on_tp_ranks_and_matches_one_process(all_ranks, arch):
    ranks = [by_arch[arch] for by_arch in all_ranks]
    first = _as_tensors(ranks[0]["adapter"])
    assert len(first) == 2 * len(TARGETS[arch]) * 2  # A and B, every target, 2 layers
    for other in ranks[1:]:
        for key, value in _as_tensors(other["adapter"]).items():
            assert torch.equal(value, first[key]), f"{key} differs between TP ranks"
    ref = _as_tensors(ranks[0]["ref_adapter"])
    assert first.keys() == ref.keys()
    for key, value in first.items():
        assert_close(value, ref[key], atol=1e-4, rtol=0)
    assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ranks[0]["ref_losses"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_saved_adapter_loads_on_plain_model_with_same_logits(all_ranks, arch):
    ranks = [by_arch[arch] for by_arch in all_ranks]
    loaded = torch.as_tensor(ranks[0]["loaded_logits"])
    for rank in ranks:
        assert_close(torch.as_tensor(rank["logits"]), loaded, atol=1e-5, rtol=0)

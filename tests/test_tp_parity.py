"""Tensor parallelism against a single process: logits, 5 optimizer steps of losses and clipped gradient
norms, parameters after them.

Every rank builds the same tiny model twice (same seed): one is the single-process reference fed the whole
global batch, the other is parallelised and fed its data-parallel share. One spawn runs several cases (a
process launch costs seconds); each case is asserted by its own test. Shared by the other ``test_tp_*`` files.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from dist_utils import run_distributed

STEPS = 5
MAX_NORM = 0.5
BATCH, SEQ, VOCAB = 4, 16, 512
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa",
)


def tiny_config(arch: str, **overrides):
    """A tiny config of family ``arch`` (GQA: 4 heads, 2 kv heads; hidden 64; vocab 512)."""
    import transformers

    kwargs = {**COMMON, **overrides}
    if arch == "llama":
        return transformers.LlamaConfig(**kwargs)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **kwargs)
    if arch == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **kwargs)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, use_sliding_window=False, **kwargs)
    if arch == "gpt_neox":
        kwargs.pop("num_key_value_heads")
        return transformers.GPTNeoXConfig(rotary_pct=0.5, **kwargs)
    if arch == "phi3":
        return transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **kwargs)
    raise ValueError(arch)


def build(arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)


def global_batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def gather_vocab(logits: torch.Tensor, tp_mesh) -> torch.Tensor:
    """Whole logits from vocab-sharded ones (test-only: this is what vocab parallelism avoids)."""
    parts = [torch.empty_like(logits) for _ in range(tp_mesh.size())]
    dist.all_gather(parts, logits.contiguous(), group=tp_mesh.get_group())
    return torch.cat(parts, dim=-1)


def grad_norm(model, max_norm: float, *, distributed: bool) -> float:
    """Clip and return the global gradient norm, the way the HF Trainer does it for each kind of model.

    For parallelised models that is ``Trainer._mixed_mesh_grad_norm`` (one norm per device mesh, plain
    tensors included; it reads nothing from the Trainer instance).
    """
    if not distributed:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    from transformers import Trainer

    return float(Trainer._mixed_mesh_grad_norm(None, model, max_norm))


def train(model, batch: torch.Tensor, steps: int, *, dp_group=None, distributed: bool = False) -> tuple[list, list]:
    """``steps`` AdamW steps with gradient clipping (active: the norms stay above ``MAX_NORM``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(grad_norm(model, MAX_NORM, distributed=distributed))
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(value, group=dp_group)
            value /= dist.get_world_size(dp_group)
        losses.append(value.item())
    return losses, norms


def _mlp_only_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }


USER_PLANS = {"mlp_only": _mlp_only_plan}
"""Plans passed with ``plan=`` (built in the rank: styles are not sent between processes)."""


def run_case(case: dict) -> dict:
    """Run one case on this rank; returns reference and parallel logits, losses and parameters."""
    from hf_dist import ParallelDims
    from hf_dist import parallelize
    from hf_dist.state_dict import full_state_dict

    arch, overrides = case["arch"], dict(case.get("overrides", ()))
    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, tp=case["tp"], dp_shard=world // case["tp"])
    dims.build_mesh("cpu")
    batch = global_batch()
    reference, model = build(arch, **overrides), build(arch, **overrides)
    parallelize(
        model, dims, fsdp=case.get("dp", "fsdp") == "fsdp" and dims.dp > 1,
        tp_plan=USER_PLANS[case["plan"]]() if "plan" in case else None,
        sequence_parallel=case.get("sp", False), vocab_parallel=case.get("vp", False),
    )
    dp_rank = dims.get_mesh("dp").get_local_rank()
    rows = batch.chunk(dims.dp)[dp_rank]
    with torch.no_grad():
        ref_logits = reference(input_ids=batch).logits.chunk(dims.dp)[dp_rank]
        logits = model(input_ids=rows).logits
    if case.get("vp"):
        logits = gather_vocab(logits, dims.get_mesh("tp"))
    dp_group = dims.get_mesh("dp").get_group() if dims.dp > 1 else None
    result = {"ref_logits": ref_logits, "logits": logits}
    result["ref_losses"], result["ref_norms"] = train(reference, batch, STEPS)
    result["losses"], result["norms"] = train(model, rows, STEPS, dp_group=dp_group, distributed=True)
    params = full_state_dict(model)
    result["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    result["params"] = params
    return result


def to_numpy(tree):
    """Tensors as numpy arrays: torch tensors sent through a multiprocessing queue need the sender alive."""
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    return tree.detach().cpu().numpy() if isinstance(tree, torch.Tensor) else tree


def _run_cases(rank, world_size, cases):
    return {name: to_numpy(run_case(case)) for name, case in cases.items()}


@functools.lru_cache(maxsize=None)
def results(world_size: int, cases_key: tuple) -> list[dict]:
    """Per-rank results of one spawn running every case in ``cases_key`` (cached across tests)."""
    cases = {name: dict(case) for name, case in cases_key}
    return run_distributed(_run_cases, world_size, cases)


def freeze(cases: dict) -> tuple:
    return tuple((name, tuple(sorted(case.items()))) for name, case in cases.items())


def _tensors(tree):
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    return torch.as_tensor(tree) if not isinstance(tree, (float, int)) else tree


def check_case(per_rank: list[dict], name: str) -> None:
    for rank, by_case in enumerate(per_rank):
        r = _tensors(by_case[name])
        assert_close(r["logits"], r["ref_logits"], atol=1e-5, rtol=0, msg=lambda m: f"rank {rank} logits: {m}")
        assert_close(
            torch.as_tensor(r["losses"]), torch.as_tensor(r["ref_losses"]), atol=1e-5, rtol=0,
            msg=lambda m: f"rank {rank} losses: {m}",
        )
        assert min(r["ref_norms"]) > MAX_NORM  # clipping active
        assert_close(
            torch.as_tensor(r["norms"]), torch.as_tensor(r["ref_norms"]), atol=0, rtol=1e-5,
            msg=lambda m: f"rank {rank} grad norms: {m}",
        )
        assert r["params"].keys() == r["ref_params"].keys()
        for key, value in r["params"].items():
            assert_close(value, r["ref_params"][key], atol=1e-4, rtol=0, msg=lambda m: f"rank {rank} {key}: {m}")


TP2_CASES = {
    "llama": {"arch": "llama", "tp": 2},
    "mistral": {"arch": "mistral", "tp": 2},
    "qwen2": {"arch": "qwen2", "tp": 2},
    "qwen3": {"arch": "qwen3", "tp": 2},
    "phi3": {"arch": "phi3", "tp": 2},
    "gpt_neox": {"arch": "gpt_neox", "tp": 2},
    "llama_user_plan": {"arch": "llama", "tp": 2, "plan": "mlp_only"},
    "llama_mqa_sp": {"arch": "llama", "tp": 2, "sp": True, "overrides": (("num_key_value_heads", 1),)},
    "qwen3_mqa": {"arch": "qwen3", "tp": 2, "overrides": (("num_key_value_heads", 1),)},
    "llama_sp_vp": {"arch": "llama", "tp": 2, "sp": True, "vp": True},
    "qwen3_sp": {"arch": "qwen3", "tp": 2, "sp": True},  # head norms whole beside the sequence-split norms
    "phi3_sp": {"arch": "phi3", "tp": 2, "sp": True},  # fused q/k/v and gate/up behind the sequence gather
    "qwen2_tied_vp": {"arch": "qwen2", "tp": 2, "vp": True, "overrides": (("tie_word_embeddings", True),)},
}


@pytest.mark.parametrize("name", list(TP2_CASES))
def test_tp2_matches_single_process(name):
    check_case(results(2, freeze(TP2_CASES)), name)


DP_TP_CASES = {
    "llama_fsdp_x_tp": {"arch": "llama", "tp": 2, "dp": "fsdp"},
    "llama_replicate_x_tp": {"arch": "llama", "tp": 2, "dp": "replicate"},
    "phi3_fsdp_x_tp_vp": {"arch": "phi3", "tp": 2, "dp": "fsdp", "vp": True},
    "qwen2_mqa_fsdp_x_tp": {"arch": "qwen2", "tp": 2, "dp": "fsdp", "overrides": (("num_key_value_heads", 1),)},
}


@pytest.mark.parametrize("name", list(DP_TP_CASES))
def test_dp2_x_tp2_matches_single_process(name):
    check_case(results(4, freeze(DP_TP_CASES)), name)

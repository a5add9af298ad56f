"""``hf_dist.from_pretrained`` with ``ep_size=2`` x FSDP2 on 2 gloo ranks: the streaming load fills each rank's
expert slices from checkpoints in the models' own per-expert key format (``save_pretrained`` output: Mixtral's
``block_sparse_moe.experts.N.w1``, Qwen3-MoE's ``mlp.experts.N.gate_proj``), assembled by transformers' converter,
and the laid-out model equals ``from_pretrained`` in one process, every tensor exactly (``parity.assert_parity``,
router and expert weights required among them). Models: the parity harness's EP cases (``parity.tiny_config``)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from parity import assert_parity, tiny_config, tiny_model

NAMES = ("mixtral", "qwen3_moe")


def _load(rank, world, root):
    import hf_dist
    from hf_dist import DistTrainingArguments
    from hf_dist.state_dict import full_state_dict

    out = {}
    for name in NAMES:
        args = DistTrainingArguments(output_dir=f"{root}/out", fsdp2=True, ep_size=2, report_to=[])
        model = hf_dist.from_pretrained(f"{root}/{name}", args)
        experts = model.model.layers[0].mlp.experts
        out[name] = {"state": full_state_dict(model), "local_experts": experts.num_experts,
                     "local_rows": experts.gate_up_proj.to_local().shape[0]}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_load")
    for name in NAMES:
        tiny_model(tiny_config(name, "ep")).save_pretrained(root / name)
    return root


def _assert_equal(got: dict, expected: dict, name: str, what: str) -> None:
    """Every tensor (the same keys) exactly equal; a router and an expert weight among them."""
    assert_parity({"losses": [], "state": got}, {"losses": [], "state": expected}, atol=0,
                  config=tiny_config(name, "ep"), what=what)


def test_streaming_load_gives_each_rank_its_experts(saved):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stored = load_file(str(saved / "mixtral" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in stored  # per-expert keys on disk
    per_rank = run_distributed(_load, 2, str(saved))
    for name in NAMES:
        expected = AutoModelForCausalLM.from_pretrained(str(saved / name), dtype=torch.float32).state_dict()
        for rank, result in enumerate(per_rank):
            got = result[name]
            assert got["local_experts"] == 2 and got["local_rows"] == 2  # 2 of 4 experts; efsdp = 1 keeps them whole
            _assert_equal(got["state"], expected, name, f"{name} rank {rank}")


def _load_tp(rank, world, root):
    import hf_dist
    from hf_dist import DistTrainingArguments
    from hf_dist.state_dict import full_state_dict

    out = {}
    for name in NAMES:
        args = DistTrainingArguments(output_dir=f"{root}/out", tp_size=2, report_to=[])
        model = hf_dist.from_pretrained(f"{root}/{name}", args)
        experts = model.model.layers[0].mlp.experts
        out[name] = {"state": full_state_dict(model), "local": tuple(experts.gate_up_proj.to_local().shape),
                     "streamed": args.layout.streaming_load}
    return out


def test_streaming_load_under_tp_gives_each_rank_its_gate_and_up_slices(saved):
    """TP=2 splits every expert's fused ``[gate | up]`` part by part (rank r: ``[gate_r | up_r]``, two runs of
    rows): the streamed load reads both runs, from the per-expert keys on disk."""
    from transformers import AutoModelForCausalLM

    per_rank = run_distributed(_load_tp, 2, str(saved))
    for name in NAMES:
        expected = AutoModelForCausalLM.from_pretrained(str(saved / name), dtype=torch.float32).state_dict()
        for rank, result in enumerate(per_rank):
            got = result[name]
            whole = expected["model.layers.0.mlp.experts.gate_up_proj"].shape
            assert got["streamed"] and got["local"] == (whole[0], whole[1] // 2, whole[2])
            _assert_equal(got["state"], expected, name, f"{name} rank {rank}")

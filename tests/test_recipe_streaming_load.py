"""The Harbor recipe's 13B path loads through hf_dist's streaming loader, with a tiny model in place of the 13B.

The recipe's own ``parse`` and ``build_model`` run with ``--preset 13b`` under the environment that
``accelerate launch --config_file accelerate_configs/harbor_13b_*.yaml`` hands its processes (computed by
accelerate's launcher code), on 2 gloo ranks. Only ``--model_name_or_path`` (a tiny Llama saved in bf16, as
Llama-2-13b-hf ships 16-bit weights) and ``--output_dir`` differ from the real command. Each rank must come back
with FSDP2 shards filled by ``stream_weights`` (the load report in the model's layout mark: every checkpoint key
read, about half the bytes per rank), in the dtype the preset keeps (fp32 master weights for the full fine-tune;
a bf16 base under ``--lora``), and the gathered weights must equal the checkpoint's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import launcher_env, load_recipe, run_distributed

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # name: (accelerate config, extra recipe flags)
    "fsdp_full": ("harbor_13b_fsdp_8gpu.yaml", []),
    "fsdp_lora": ("harbor_13b_fsdp_8gpu.yaml", ["--lora", "true", "--lora_r", "4"]),
    "grad_op_full": ("harbor_13b_fsdp_grad_op_8gpu.yaml", []),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=20000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    directory = tmp_path_factory.mktemp("llama13b_stand_in")
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
    return str(directory)


def _envs() -> dict[str, tuple[dict, list[str]]]:
    out = {}
    for name, (yaml_name, extra) in CASES.items():
        _, env = launcher_env(ROOT / "accelerate_configs" / yaml_name)
        out[name] = ({k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}, extra)
    return out


def _load(rank: int, world_size: int, model_dir: str, output_dir: str, envs: dict) -> dict:
    import os
    from unittest import mock

    from torch.distributed.tensor import DTensor

    from hf_dist.state_dict import full_state_dict
    from hf_dist.trainer.laid_out import LAYOUT_ATTR

    recipe = load_recipe()
    results = {}
    for name, (env, extra) in envs.items():
        with mock.patch.dict(os.environ, env):
            argv = ["--preset", "13b", "--model_name_or_path", model_dir, "--output_dir", f"{output_dir}/{name}"]
            script, args = recipe.parse(argv + extra)
            model = recipe.build_model(script, args, None)  # the recipe's own call, as main() makes it
        mark = model.__dict__[LAYOUT_ATTR]  # only hf_dist.from_pretrained's streaming path sets it
        params = dict(model.named_parameters())
        state = full_state_dict(model)  # collective: every rank gathers
        results[name] = {
            "fsdp": mark.fsdp, "dims": (mark.dims.dp_shard, mark.dims.tp, mark.dims.pp), "bf16": args.bf16,
            "loaded": sorted(set(mark.load.loaded)), "bytes_read": mark.load.bytes_read,
            "sharded": all(isinstance(p, DTensor) for p in params.values()),
            "local_numel": {n: p._local_tensor.numel() for n, p in params.items()},
            "numel": {n: p.numel() for n, p in params.items()},
            "dtypes": {n: p.dtype for n, p in params.items()},
            "state": state if rank == 0 else None,
        }
    return results


def test_the_13b_preset_loads_through_the_streaming_loader(model_dir, tmp_path):
    from safetensors.torch import load_file

    from hf_dist.loading.slices import checkpoint_key

    checkpoint = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        checkpoint.update(load_file(path))
    total = sum(t.numel() * t.element_size() for t in checkpoint.values())
    per_rank = run_distributed(_load, 2, model_dir, str(tmp_path), _envs(), timeout_s=600)
    for name in CASES:
        lora = "lora" in name
        results = [r[name] for r in per_rank]
        for rank, r in enumerate(results):
            assert r["fsdp"] and r["dims"] == (2, 1, 1) and r["bf16"] and r["sharded"], (name, rank)
            assert r["loaded"] == sorted(checkpoint), (name, rank, set(r["loaded"]) ^ set(checkpoint))
            assert r["bytes_read"] < 0.6 * total, (name, rank, r["bytes_read"], total)  # its slices, not the model
            for param, dtype in r["dtypes"].items():
                want = torch.float32 if not lora or "lora_" in param else torch.bfloat16
                assert dtype == want, (name, param, dtype)
        assert sum(r["bytes_read"] for r in results) == total, name  # together: every byte once
        for param, numel in results[0]["numel"].items():
            assert sum(r["local_numel"][param] for r in results) == numel, (name, param)
        state = {checkpoint_key(k): v for k, v in results[0]["state"].items() if "lora_" not in k}
        assert sorted(state) == sorted(checkpoint), name
        for key, value in checkpoint.items():
            torch.testing.assert_close(state[key], value.to(state[key].dtype), rtol=0, atol=0, msg=f"{name} {key}")

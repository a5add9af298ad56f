"""A model the layout cannot run is refused from its config, before any weights load or file is written (issue 27.11).

EP on a dense model, CP on a model type or head count CP does not run: ``hf_dist.check_model_support`` asks the
parallelisms' own checks. The Harbor recipe asks it in ``parse`` (before it prepares data into ``--output_dir``)
and ``hf_dist.from_pretrained`` right after reading the config. The multi-rank case runs on 2 gloo ranks (the
arguments of a 2-process world start the process group) with every loader and data step replaced by a failure.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dist_utils import run_distributed

EP_DENSE = r"ep_size=2 is refused: .*set ep_size=1"
CP_TYPE = r"model_type='gpt_neox' has no context-parallel parity test in hf_dist; .*llama.*drop cp_size"
CP_HEADS = r"cp_size=2 does not divide num_attention_heads=4 and num_key_value_heads=1: .*use cp_size in \[1\]"


def _save(directory, model_type: str, **fields) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64, **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("support")
    return {"llama": _save(root / "llama", "llama", num_key_value_heads=2),
            "llama_kv1": _save(root / "llama_kv1", "llama", num_key_value_heads=1),
            "gpt_neox": _save(root / "gpt_neox", "gpt_neox")}


def _loaded(*_args, **_kwargs):
    raise AssertionError("weights or data were loaded before the refusal")


def _refusal(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no refusal"


CASES = {  # name: (model, recipe flags or from_pretrained arguments, environment)
    "recipe_ep_dense": ("llama", ["--ep_size", "2"], {}),
    "recipe_cp_type": ("gpt_neox", ["--cp_size", "2"], {}),
    "recipe_cp_heads_yaml": ("llama_kv1", [], {"ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                                               "PARALLELISM_CONFIG_CP_SIZE": "2"}),  # an accelerate YAML's request
    "from_pretrained_ep_dense": ("llama", {"ep_size": 2}, {}),
    "from_pretrained_cp_type": ("gpt_neox", {"cp_size": 2}, {}),
    "from_pretrained_cp_heads_fsdp2": ("llama_kv1", {"cp_size": 2, "fsdp2": True}, {}),
}


def _ranks(rank, world_size, model_dirs: dict, root: str) -> dict:
    import hf_dist
    from hf_dist import DistTrainingArguments
    from hf_dist.loading import meta
    from hf_dist.trainer import pretrained
    from tests.dist_utils import load_recipe

    recipe = load_recipe()
    out = {}
    with mock.patch.object(meta, "build_on_meta", _loaded), mock.patch.object(meta, "transformers_load", _loaded), \
            mock.patch.object(pretrained, "stream_weights", _loaded), \
            mock.patch.object(recipe, "prepare_data", _loaded), mock.patch.object(recipe, "build_model", _loaded):
        for name, (model, given, env) in CASES.items():
            output_dir = f"{root}/{name}"
            with mock.patch.dict(os.environ, env):
                if isinstance(given, list):
                    argv = ["--model_name_or_path", model_dirs[model], "--output_dir", output_dir, *given]
                    message = _refusal(lambda: recipe.main(argv))
                else:
                    args = DistTrainingArguments(output_dir=output_dir, report_to=[], use_cpu=True, **given)
                    message = _refusal(lambda: hf_dist.from_pretrained(model_dirs[model], args))
            out[name] = {"message": message, "written": os.path.exists(output_dir)}
    return out


@pytest.fixture(scope="module")
def refusals(model_dirs, tmp_path_factory):
    return run_distributed(_ranks, 2, model_dirs, str(tmp_path_factory.mktemp("out")))


@pytest.mark.parametrize("case, match", [
    ("recipe_ep_dense", EP_DENSE), ("recipe_cp_type", CP_TYPE), ("recipe_cp_heads_yaml", CP_HEADS),
    ("from_pretrained_ep_dense", EP_DENSE), ("from_pretrained_cp_type", CP_TYPE),
    ("from_pretrained_cp_heads_fsdp2", CP_HEADS),
])
def test_refused_from_the_config_before_weights_load_or_files_are_written(refusals, case, match):
    import re

    for rank in refusals:
        assert re.search(match, rank[case]["message"]), rank[case]["message"]
        assert not rank[case]["written"]


def _layout_args(**fields):
    from hf_dist.strategy import Layout

    return SimpleNamespace(layout=Layout(**{"strategy": "ddp", "num_gpus": 2, **fields}))


def test_one_check_for_every_parallelism_pure():
    """No process group: each size asks its parallelism's own rule; a layout of size 1 asks nothing."""
    from transformers import AutoConfig

    from hf_dist import check_model_support

    llama = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, vocab_size=63)
    check_model_support(None, _layout_args())  # nothing to split: a model without config is the Trainer's
    check_model_support(llama, _layout_args(cp=2))
    with pytest.raises(ValueError, match=EP_DENSE):
        check_model_support(llama, _layout_args(ep=2))
    with pytest.raises(ValueError, match=CP_TYPE):
        check_model_support(AutoConfig.for_model("gpt_neox"), _layout_args(cp=2))
    with pytest.raises(ValueError, match=r"tp=2 does not divide vocab_size=63"):
        check_model_support(llama, _layout_args(tp=2, vocab_parallel=True))
    with pytest.raises(ValueError, match=r"pp_size > 1 is not supported: .*bert"):
        check_model_support(AutoConfig.for_model("bert"), _layout_args(pp=2))
    with pytest.raises(ValueError, match=r"the model has no config: tp_size=1, pp_size=1, ep_size=2"):
        check_model_support(None, _layout_args(ep=2))

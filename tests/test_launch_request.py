"""The launch request is read once into typed fields and never deleted: every arguments object in a process sees it.

Pure tests check that the ``fsdp2*`` fields survive ``to_dict``, ``to_json_string``, ``dataclasses.replace`` and a
re-parse, and that the environment is left as the launcher wrote it. One 2-rank gloo run builds two trainers one
after the other under an accelerate FSDP environment and checks that both really shard with FSDP2 and that accelerate
never built an FSDP plugin of its own (on GPU it would wrap the hf_dist-sharded model a second time).
"""

import dataclasses
import json
import os
import tempfile
from types import SimpleNamespace

import pytest
from transformers import HfArgumentParser

from dist_utils import run_distributed
from hf_dist import DistTrainingArguments
from hf_dist.trainer import launch_env

ACCELERATE_FSDP_ENV = {  # as `accelerate launch` writes it for an FSDP v2 YAML (non-default settings)
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_RESHARD_AFTER_FORWARD": "false",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_ACTIVATION_CHECKPOINTING": "true",
}


@pytest.fixture
def fsdp_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")) or key == "WORLD_SIZE":
            monkeypatch.delenv(key)
    for key, value in ACCELERATE_FSDP_ENV.items():
        monkeypatch.setenv(key, value)


def _expected_request(request):
    assert request is not None
    assert request.reshard_after_forward is False
    assert request.wrap_classes == ("LlamaDecoderLayer",)
    assert request.activation_checkpointing is True


def test_request_survives_replace_to_dict_and_json(fsdp_env, tmp_path):
    first = DistTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    second = DistTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    replaced = dataclasses.replace(first, learning_rate=3e-4)
    for args in (first, second, replaced):
        _expected_request(args.hf_dist_fsdp)
        assert not args.fsdp  # the Trainer's own FSDP plugin stays off
    assert {k: os.environ.get(k) for k in ACCELERATE_FSDP_ENV} == ACCELERATE_FSDP_ENV  # read, not consumed
    as_dict = first.to_dict()
    assert as_dict["fsdp2"] is True and as_dict["fsdp2_wrap_classes"] == ["LlamaDecoderLayer"]
    assert json.loads(first.to_json_string())["fsdp2_reshard_after_forward"] is False
    for key in list(ACCELERATE_FSDP_ENV):  # without the launcher's env, the fields alone carry the request
        del os.environ[key]
    rebuilt = DistTrainingArguments(**{k: v for k, v in as_dict.items() if not k.endswith("_token")})
    _expected_request(rebuilt.hf_dist_fsdp)
    assert DistTrainingArguments(output_dir=str(tmp_path), use_cpu=True).hf_dist_fsdp is None


def test_request_fields_parse_from_the_command_line(tmp_path):
    (args,) = HfArgumentParser(DistTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--use_cpu", "--fsdp2", "--fsdp2_reshard_after_forward", "false",
              "--fsdp2_wrap_classes", "LlamaDecoderLayer"]
    )
    request = args.hf_dist_fsdp
    assert (request.reshard_after_forward, request.wrap_classes) == (False, ("LlamaDecoderLayer",))
    assert args.layout.strategy == "fsdp_shard_grad_op"


def test_accelerate_view_masks_the_flags_only_while_the_accelerator_is_built(fsdp_env, tmp_path):
    args = DistTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    with launch_env.accelerate_view(args):
        assert "ACCELERATE_USE_FSDP" not in os.environ
        assert os.environ["FSDP_VERSION"] == "2"  # the request itself is untouched
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"
    with launch_env.accelerate_view(SimpleNamespace(fsdp2=False)):  # not hf_dist's FSDP2: accelerate sees its flags
        assert os.environ["ACCELERATE_USE_FSDP"] == "true"


def _two_trainers_rank(rank, world_size):
    """Two DistTrainingArguments (a fresh one and a dataclasses.replace) under one accelerate FSDP environment."""
    import accelerate.accelerator
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from hf_dist import DistTrainer
    from hf_dist.models import build_tiny_model
    from trainer_harness import token_dataset

    os.environ.update(ACCELERATE_FSDP_ENV)
    built_plugins = []
    plugin_class = accelerate.accelerator.FullyShardedDataParallelPlugin
    original_post_init = plugin_class.__post_init__

    def spy(self, *a, **kw):
        built_plugins.append(self)
        return original_post_init(self, *a, **kw)

    plugin_class.__post_init__ = spy
    results = []
    with tempfile.TemporaryDirectory() as out:
        settings = dict(output_dir=out, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, logging_steps=1)
        first = DistTrainingArguments(**settings)
        for args in (first, DistTrainingArguments(**settings), dataclasses.replace(first, seed=0)):
            trainer = DistTrainer(model=build_tiny_model(vocab_size=256, hidden_size=32, num_hidden_layers=2),
                                  args=args, train_dataset=token_dataset(16))
            trainer.train()
            params = list(trainer.model.parameters())
            results.append({
                "fsdp_blocks": sum(isinstance(m, FSDPModule) for m in trainer.model.modules()),
                "all_dtensor": all(isinstance(p, DTensor) for p in params),
                "local_fraction": sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params),
                "num_processes": trainer.accelerator.num_processes,
                "reshard": args.fsdp2_reshard_after_forward,
                "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            })
    results.append({"plugins": len(built_plugins), "env": {k: os.environ.get(k) for k in ACCELERATE_FSDP_ENV}})
    return results


def test_two_arguments_in_one_process_both_train_fsdp2():
    for rank_results in run_distributed(_two_trainers_rank, 2):
        *runs, summary = rank_results
        for run in runs:
            assert run["fsdp_blocks"] == 5  # two decoder layers, the (untied) input embedding and head, the root
            assert run["all_dtensor"] and run["local_fraction"] < 0.6  # really sharded over 2 ranks, not DDP
            assert run["num_processes"] == 2 and run["reshard"] is False
        assert runs[0]["losses"] == runs[1]["losses"] == runs[2]["losses"]
        assert summary["plugins"] == 0  # accelerate never built an FSDP plugin of its own
        assert summary["env"] == ACCELERATE_FSDP_ENV

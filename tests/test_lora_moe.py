"""LoRA on a mixture-of-experts model: adapters on attention and, through PEFT's ``target_parameters``, on the
3-D expert weights (``mlp.experts.gate_up_proj`` / ``down_proj``). Under FSDP2, EP=2 x FSDP2 (each rank holding its
experts' adapters; also with activation checkpointing) and EP=2 x DDP on 2 gloo ranks the adapters train equal to one
process (tiny qwen3_moe from ``parity.tiny_config``, aux loss on): losses, the first optimizer step's adapter gradients
and every parameter, the frozen router and experts included (``trainer_harness.trainer_run``,
``parity.assert_parity``); the adapter DistTrainer saves under EP reloads with ``AutoPeftModelForCausalLM`` and gives the
one-process trained model's logits, and PEFT's own ``merge_and_unload`` of it too. hf_dist's merged export of expert
adapters equals ``merge_and_unload`` in every value.
"""

import tempfile

import torch

from dist_utils import run_distributed
from parity import assert_parity, tiny_config, tiny_model
from trainer_harness import VOCAB, trainer_run

TARGETS = dict(target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _config():
    config = tiny_config("qwen3_moe", "ep")
    config.vocab_size = VOCAB
    return config


def peft_moe(base_dir):
    """The adapter's base written by transformers' ``save_pretrained`` (per-expert keys, as on the Hub) and loaded
    from it as a user's, then PEFT's adapters added."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from hf_dist.models import add_adapters

    if not (base_dir / "config.json").exists():  # written once, by the caller, before ranks are spawned
        tiny_model(_config()).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.name_or_path = model.config.name_or_path = str(base_dir)
    return add_adapters(model, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **TARGETS), seed=0)


FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
LAYOUTS = {"fsdp2": FSDP2, "ep2_fsdp2": FSDP2 | {"ep_size": 2},
           "ep2_fsdp2_recompute": FSDP2 | {"ep_size": 2, "gradient_checkpointing": True},  # the dispatch recomputed
           "ep2_ddp": {"ep_size": 2}}  # the frozen expert shards must not be broadcast over dp (each rank's differ)
PROBE = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _train(base_dir, extra=None, save_to=None):
    with tempfile.TemporaryDirectory() as out:
        run, trainer = trainer_run(out, max_steps=3, model=peft_moe(base_dir), global_batch_size=8,
                                   per_device_train_batch_size=2, **(extra or {}))
        if save_to is not None:
            trainer.save_model(str(save_to))
    assert run["grads"] and all("lora_" in k for k in run["grads"])  # only the adapters train
    return run, trainer


def _local_experts(trainer) -> list[int]:
    """The experts each EP experts module and each PEFT wrapper inside it computes on this rank."""
    from hf_dist.expert_parallel import expert_modules

    return [m.num_experts for e in expert_modules(trainer.model) for m in e.modules() if hasattr(m, "num_experts")]


def _layouts(rank, world_size, base_dir, save_to):
    """Every layout in one process group; the EP run saves its adapter."""
    runs = {}
    for name, extra in LAYOUTS.items():
        run, trainer = _train(base_dir, extra, save_to if name == "ep2_fsdp2" else None)
        runs[name] = run, _local_experts(trainer)
    return runs


def test_expert_lora_under_fsdp2_and_ep_equals_one_process(tmp_path):
    from peft import AutoPeftModelForCausalLM

    base = tmp_path / "base"
    reference, trainer = _train(base)
    assert any(".mlp.experts." in k for k in reference["grads"])  # the 3-D expert weights carry adapters
    model = trainer.model.eval()
    expected = model(input_ids=PROBE).logits.detach()
    runs = run_distributed(_layouts, 2, base, tmp_path / "ep_adapter")[0]
    # under EP each rank computes 2 of the 4 experts, through PEFT's wrappers too (not all 4 on one rank)
    assert runs["ep2_fsdp2"][1] == [2] * 6, runs["ep2_fsdp2"][1]  # 2 layers x (2 wrappers + the experts)
    for layout, (run, _) in runs.items():
        assert_parity(run, reference, config=_config(), what=f"{layout} vs one process")
    base_logits = type(model.get_base_model()).from_pretrained(base)(input_ids=PROBE).logits
    assert (base_logits - expected).abs().max() > 1e-3  # the trained adapters move the logits
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "ep_adapter").eval()
    torch.testing.assert_close(reloaded(input_ids=PROBE).logits, expected, atol=1e-5, rtol=0)
    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(merged(input_ids=PROBE).logits, expected, atol=1e-5, rtol=0)


def test_expert_adapter_reloads_and_merges_as_peft(tmp_path):
    """PEFT reloads the adapter with the same logits; hf_dist's merged export of a checkpoint of it equals PEFT's own
    ``merge_and_unload`` in every value (and passes its PEFT-backed tensor verification)."""
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file

    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint
    from hf_dist.checkpoint.export import export_checkpoint

    model = peft_moe(tmp_path / "base")
    with torch.no_grad():  # B is zero at init: move every adapter so the reload and merge are not trivial
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "adapter")
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=None, step=0, samples_consumed=0,
                    layout=ParallelDims(world_size=1), batch_contract=None)
    report = export_checkpoint(tmp_path / "ckpt", tmp_path / "merged_export", adapter="merged")
    assert report.verification == "tensors"
    ids = PROBE
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    expected = model(input_ids=ids).logits
    torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    written = load_file(str(tmp_path / "merged_export" / "model.safetensors"))
    peft_merged = merged.state_dict()
    assert set(written) == set(peft_merged) and report.tensors_verified == len(written)
    torch.testing.assert_close(written, {k: peft_merged[k] for k in written}, atol=0, rtol=0)
    unmerged = model.get_base_model().model.layers[1].mlp.experts.base_layer.base_layer.down_proj
    assert (written["model.layers.1.mlp.experts.down_proj"] - unmerged).abs().max() > 1e-3  # the merge moved it

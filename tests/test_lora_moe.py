"""LoRA on a mixture-of-experts model: adapters on attention and, through PEFT's ``target_parameters``, on the
3-D expert weights (``mlp.experts.gate_up_proj`` / ``down_proj``). Under FSDP2 on 2 gloo ranks the adapters train
equal to one process (aux loss on); the saved adapter reloads with ``AutoPeftModelForCausalLM`` and gives the
trained model's logits; its merge is PEFT's own (hf_dist's merged export refuses parameter adapters by name).
"""

import tempfile

import torch

from dist_utils import run_distributed
from trainer_harness import VOCAB, train_tiny

TARGETS = dict(target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def peft_moe(base_dir=None):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from hf_dist.models import add_adapters

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.5,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if base_dir is not None:  # the adapter's base on disk, saved before PEFT wraps the expert parameters
        model.save_pretrained(base_dir)
        model.name_or_path = model.config.name_or_path = str(base_dir)
    return add_adapters(model, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **TARGETS), seed=0)


def _train(rank=0, world_size=1, extra=None):
    with tempfile.TemporaryDirectory() as out:
        losses, params, _ = train_tiny(out, max_steps=3, model=peft_moe(), global_batch_size=8,
                                       per_device_train_batch_size=2, **(extra or {}))
    return losses, {k: v for k, v in params.items() if "lora_" in k}


def test_expert_lora_under_fsdp2_equals_one_process():
    losses, adapters = _train()
    assert any(".mlp.experts." in k for k in adapters)  # the 3-D expert weights carry adapters
    fsdp = run_distributed(_train, 2, {"fsdp": "full_shard", "fsdp_config": {"version": 2}})[0]
    torch.testing.assert_close(fsdp[0], losses, atol=1e-5, rtol=0)
    assert set(fsdp[1]) == set(adapters)
    for key, value in adapters.items():
        torch.testing.assert_close(fsdp[1][key], value, atol=1e-5, rtol=0, msg=key)


def test_expert_adapter_reloads_and_merges_as_peft(tmp_path):
    from peft import AutoPeftModelForCausalLM

    model = peft_moe(tmp_path / "base")
    with torch.no_grad():  # B is zero at init: move every adapter so the reload and merge are not trivial
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    reloaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    expected = model(input_ids=ids).logits
    torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)

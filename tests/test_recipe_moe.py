"""End to end: the Harbor recipe on a mixture-of-experts model whose config sets ``output_router_logits=True``.

Its evaluation once crashed (the Trainer hands the metric the aux loss first); now the recipe trains, evaluates
before and after, saves and reloads a tiny qwen3_moe on one process and under FSDP2 on 2 gloo ranks, and the
FSDP2 run equals the single process's through ``parity.assert_parity`` (logged losses and gradient norms, every saved
weight, a router and an expert weight among them), its perplexities within 1e-5 relative.
"""

import pytest
import torch

from launch_harness import launch, launched_run, one_process
from parity import assert_parity

MOE = ["--eval_fraction", "0.1", "--per_device_eval_batch_size", "4"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from hf_dist.data import prepare_demo_data

    root = tmp_path_factory.mktemp("qwen3_moe")
    _, tok = prepare_demo_data(root / "demo", n=32, seed=0, vocab_size=1024)
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.3, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return str(root / "model")


def test_recipe_trains_and_evaluates_a_moe_model_on_one_process_and_fsdp2(moe_dir, tmp_path):
    from transformers import AutoConfig

    args = ["--model_name_or_path", moe_dir, *MOE]
    single = one_process(tmp_path / "single", *args)
    fsdp = launch("fsdp", tmp_path / "fsdp", *args)
    assert fsdp["layout"].endswith("FSDP2 FULL_SHARD (hf_dist fully_shard)"), fsdp["layout"]
    for summary in (single, fsdp):
        assert len(summary["losses"]) == 5
        assert summary["perplexity_before"] > summary["perplexity_after"] > 1
        assert summary["reload"].startswith("AutoModelForCausalLM.from_pretrained: ok")
    assert_parity(launched_run(tmp_path / "fsdp"), launched_run(tmp_path / "single"),
                  config=AutoConfig.from_pretrained(moe_dir), what="FSDP2 MoE")  # router and experts compared
    for key in ("perplexity_before", "perplexity_after"):
        torch.testing.assert_close(fsdp[key], single[key], rtol=1e-5, atol=0)  # measured: equal

"""Pipeline planning and stage modules without processes: splitter, config checks, stages vs the whole model."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch.testing import assert_close

from hf_dist.pipeline_parallel import (
    CausalLMStage,
    PipelineConfig,
    TokenWeightedLoss,
    check_microbatches,
    plan_stages,
    stage_units,
    theoretical_utilisation,
)
from hf_dist.pipeline_parallel import schedules as schedules_module
from hf_dist.pipeline_parallel.token_loss import count_loss_tokens
from parity import masked_batches, tiny_config, tiny_model
from pp_sweep_cases import SEQ


def _model(case: str = "llama:gqa"):
    """The harness's PP case (grouped kv heads, attention bias; ``llama:gqa_tied`` tied)."""
    return tiny_model(tiny_config(case, "pp"))


def _rows(rows: int, step: int) -> dict[str, torch.Tensor]:
    """``rows`` right-padded rows of the harness's batches (step ``step``)."""
    return masked_batches(tiny_config("llama:gqa", "pp").vocab_size, SEQ, step + 1, rows=rows)[step]


def _layers(sizes):
    return [(f"model.layers.{i}", s) for i, s in enumerate(sizes)]


def test_first_stage_owns_embeddings_last_owns_head():
    plan = plan_stages(_layers([10] * 8), pp_size=4, embed_size=5, head_size=5)
    assert plan.stages[0][0] == "model.embed_tokens"
    assert plan.stages[-1][-2:] == ("model.norm", "lm_head")
    layers = [n for stage in plan.stages for n in stage if n.startswith("model.layers.")]
    assert layers == [f"model.layers.{i}" for i in range(8)]  # every layer once, in order


def test_balancing_minimises_the_largest_stage():
    # A large embedding pushes layers off the first stage: the best max is 40 (e.g. [E+0], [1,2,3,4], ...).
    plan = plan_stages(_layers([10] * 6), pp_size=2, embed_size=30, head_size=0)
    assert plan.stages[0] == ("model.embed_tokens", "model.layers.0")
    assert plan.stage_sizes == (40, 50)
    uneven = plan_stages(_layers([1, 1, 1, 1, 8, 8]), pp_size=2)
    assert uneven.stage_sizes == (12, 8)
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for parts in (2, 3, 4):  # against every possible set of cuts
        best = min(
            max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
            for cuts in itertools.combinations(range(1, len(sizes)), parts - 1)
        )
        assert max(plan_stages(_layers(sizes), pp_size=parts).stage_sizes) == best


def test_among_equally_good_splits_the_most_even_one_wins():
    # The embedding stage is the largest whatever the split (5 + 100): the other stages still share evenly.
    plan = plan_stages(_layers([5] * 9), pp_size=4, embed_size=100)
    assert plan.stage_sizes[0] == 105 and sorted(plan.stage_sizes[1:]) == [10, 15, 15]


def test_explicit_split_points():
    plan = plan_stages(_layers([1] * 4), pp_size=2, split_points=["model.layers.1"])
    assert plan.stages == (
        ("model.embed_tokens", "model.layers.0"),
        ("model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"),
    )
    with pytest.raises(ValueError, match="exactly 1"):
        plan_stages(_layers([1] * 4), pp_size=2, split_points=[])
    with pytest.raises(ValueError, match="not decoder layers"):
        plan_stages(_layers([1] * 4), pp_size=2, split_points=["model.layers.9"])
    with pytest.raises(ValueError, match="strictly increasing"):
        plan_stages(_layers([1] * 4), pp_size=3, split_points=["model.layers.2", "model.layers.1"])


def test_placement_loop_and_v():
    loop = plan_stages(_layers([1] * 8), pp_size=2, virtual_stages=2)
    assert [loop.local_stages(r) for r in (0, 1)] == [[0, 2], [1, 3]]
    v = plan_stages(_layers([1] * 8), pp_size=2, virtual_stages=2, placement="v")
    assert [v.local_stages(r) for r in (0, 1)] == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="virtual_stages=2"):
        plan_stages(_layers([1] * 8), pp_size=2, virtual_stages=3, placement="v")


def test_too_few_layers_is_an_error_naming_the_sizes():
    with pytest.raises(ValueError, match="4 decoder layers cannot fill pp_size=4 x virtual_stages=2 = 8"):
        plan_stages(_layers([1] * 4), pp_size=4, virtual_stages=2)


def test_schedule_config_checks():
    assert PipelineConfig(schedule="interleaved_1f1b").virtual_stages == 2
    assert PipelineConfig(schedule="gpipe").virtual_stages == 1
    with pytest.raises(ValueError, match="pp_schedule='pipedream' is not known"):
        PipelineConfig(schedule="pipedream")
    with pytest.raises(ValueError, match="exactly 2 stage"):
        PipelineConfig(schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match="exactly 1 stage"):
        PipelineConfig(schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="pp_microbatches=0"):
        PipelineConfig(microbatches=0)


def test_microbatch_split_error_and_warning_once(caplog):
    with pytest.raises(ValueError, match=r"does not split into pp_microbatches=3 .* in \[1, 2, 4, 8\]"):
        check_microbatches(8, 3, num_stages=2)
    schedules_module._warned.clear()
    with caplog.at_level(logging.WARNING, logger=schedules_module.__name__):
        assert check_microbatches(8, 2, num_stages=2) == 4
        check_microbatches(8, 2, num_stages=2)
        assert check_microbatches(8, 4, num_stages=2) == 2  # 4 >= 2 x 2: no warning
    warnings = [r for r in caplog.records if "below 2 x 2 pipeline stages" in r.getMessage()]
    assert len(warnings) == 1


def test_theoretical_utilisation():
    assert theoretical_utilisation(4, 2) == pytest.approx(0.8)
    assert theoretical_utilisation(16, 4) == pytest.approx(16 / 19)


def test_stages_in_sequence_equal_the_whole_model_with_padding():
    model = _model()
    batch = _rows(4, step=3)
    assert (batch["attention_mask"] == 0).any()  # the mask path is exercised
    with torch.no_grad():
        ref = model(**batch)
        layers, embed, head = stage_units(model)
        plan = plan_stages(layers, pp_size=2, virtual_stages=2, embed_size=embed, head_size=head)
        x = batch["input_ids"]
        for names in plan.stages:
            x = CausalLMStage(model, names)(x, attention_mask=batch["attention_mask"])
    keep = batch["attention_mask"].bool()
    assert_close(x[keep], ref.logits[keep], atol=1e-6, rtol=0)
    loss = TokenWeightedLoss()
    loss.denominator = count_loss_tokens(batch["labels"])
    microbatched = sum(loss(x[i : i + 1], batch["labels"][i : i + 1]) for i in range(4))
    assert_close(microbatched, ref.loss, atol=1e-6, rtol=0)


def test_stage_keys_are_hf_keys():
    model = _model()
    layers, embed, head = stage_units(model)
    plan = plan_stages(layers, pp_size=2, embed_size=embed, head_size=head)
    keys = set()
    for names in plan.stages:
        keys |= set(CausalLMStage(model, names).state_dict())
    assert keys == set(model.state_dict())


def test_tied_embeddings_refused_where_one_copy_cannot_be_kept():
    from hf_dist import ParallelDims
    from hf_dist.pipeline_parallel.tied import TiedEmbeddingSync, is_tied

    assert is_tied(_model("llama:gqa_tied")) and not is_tied(_model())
    loop = plan_stages(_layers([1] * 4), pp_size=2)
    with pytest.raises(ValueError, match="tied embeddings with tp=2 and pp=2"):
        TiedEmbeddingSync(ParallelDims(world_size=4, pp=2, tp=2), loop, 0)
    v = plan_stages(_layers([1] * 4), pp_size=2, virtual_stages=2, placement="v")
    with pytest.raises(ValueError, match="FSDP .dp_shard=2. would shard one weight in two FSDP units"):
        TiedEmbeddingSync(ParallelDims(world_size=4, pp=2, dp_shard=2), v, 0)


def test_models_without_a_pp_plan_are_refused():
    with pytest.raises(ValueError, match="declares no pipeline plan"):
        stage_units(torch.nn.Linear(2, 2))


def test_cli_prints_the_13b_split(capsys):
    from hf_dist.cli import main

    assert main(["pp", "--model", "llama-2-13b", "--pp", "2", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "13,015,864,320 parameters in 2 stages" in out
    assert "model.embed_tokens .. model.layers.19" in out and "model.layers.20 .. lm_head" in out
    assert "= 0.89 (bubble 11%)" in out
    assert main(["pp", "--model", "llama-2-13b", "--pp", "2", "--split-points", "model.layers.99"]) == 2
    assert "are not decoder layers" in capsys.readouterr().out


def test_pad_to_bucket_keeps_every_real_token_output():
    """Padded batches (mask, packed position_ids, neither) give the real tokens the same logits and loss."""
    from hf_dist.pipeline_parallel.pipeline import pad_to_bucket

    model = _model().eval()
    masked = _rows(2, step=5)
    packed = {"input_ids": masked["input_ids"], "labels": masked["input_ids"],
              "position_ids": torch.cat([torch.arange(12), torch.arange(20)]).expand(2, -1)}
    plain = {"input_ids": masked["input_ids"]}
    for batch in (masked, packed, plain):
        padded = pad_to_bucket(batch, 48)
        assert padded["input_ids"].shape[1] == 48 and (padded["labels"][:, 32:] == -100).all()
        with torch.no_grad():
            ref = model(**{**batch, "labels": batch.get("labels", batch["input_ids"])})
            got = model(**padded)
        keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        assert_close(got.logits[:, :32][keep], ref.logits[keep], atol=1e-5, rtol=0)
        assert_close(got.loss, ref.loss, atol=1e-6, rtol=0)
    assert pad_to_bucket(masked, 32)["input_ids"] is masked["input_ids"]  # already a multiple: untouched


@pytest.mark.parametrize("model_type", ["gptj", "codegen", "falcon", "bloom", "mpt", "bamba", "falcon_h1", "llama"])
def test_layer_output_is_read_from_the_models_code(model_type):
    """What a stand-in hands the base model's layer loop (a tensor, or a tuple of n) is read from that loop, and
    equals what the installed transformers' layer returns (5.23: GPT-J/CodeGen blocks return tuples, 5.24 tensors;
    Falcon, BLOOM, MPT tuples read by index; Bamba a tuple of 2 unpacked)."""
    import pp_sweep_cases as cases
    from transformers import AutoModelForCausalLM

    from hf_dist.pipeline_parallel.layer_output import layer_output_width
    from hf_dist.pipeline_parallel.stage_module import model_parts

    hybrid = {t: name for name, (t, _) in cases.HYBRID.items()}
    config = cases.hybrid_config(hybrid[model_type]) if model_type in hybrid else cases.non_default_config(model_type)
    model = AutoModelForCausalLM.from_config(config).eval()
    parts = model_parts(model)
    owner, _, attr = parts.layer_list.rpartition(".")
    read = layer_output_width(type(model.get_submodule(owner)), attr, model_type)
    seen = []
    model.get_submodule(parts.layer_list)[0].register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, 8)))
    if read == 0:
        assert isinstance(seen[0], torch.Tensor)
    else:  # a tuple the loop unpacks into `read` names, or indexes (read == 1: any length)
        assert isinstance(seen[0], tuple) and (len(seen[0]) == read or (read == 1 and len(seen[0]) >= 1))


def test_layer_output_override_and_unreadable_loops(monkeypatch):
    from hf_dist.families import FAMILIES, Family
    from hf_dist.pipeline_parallel import layer_output

    class Loop(torch.nn.Module):
        def forward(self, hidden_states):
            for block in self.blocks:
                out = block(hidden_states)
                hidden_states = out[0]
            return hidden_states

    class NoLoop(torch.nn.Module):
        def forward(self, hidden_states):
            return self.blocks(hidden_states)

    assert layer_output.layer_output_width(Loop, "blocks", "not-a-type") == 1
    with pytest.raises(ValueError, match="cannot read how NoLoop.forward takes the output"):
        layer_output.layer_output_width(NoLoop, "blocks", "not-a-type")
    monkeypatch.setitem(FAMILIES, "not-a-type", Family(model_type="not-a-type", kind="dense", pp_layer_output=2))
    assert layer_output.layer_output_width(NoLoop, "blocks", "not-a-type") == 2  # the registry's override wins

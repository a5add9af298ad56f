"""The per-layer activation estimate against Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), section 4.1: a GPT layer in 16-bit saves ``s·b·h·(34 + 5·a·s/h)`` bytes, with tensor
parallel ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` and with tensor + sequence parallel ``s·b·h·(34 + 5·a·s/h)/t``.

The paper's accounting is rebuilt term by term (``KORTHIKANTI``), checked to sum to those formulas exactly, and
each term is then replaced by what the HF Llama layer saves instead (``llama_terms``):

  * no dropout anywhere (Llama's ``attention_dropout`` is 0 and it has no residual or MLP dropout): the three
    1-byte masks go, and the attention-over-V input is the softmax output itself, not a dropout output;
  * eager attention's softmax runs in fp32 (``softmax(..., dtype=float32)``): it saves a 4-byte output, and the
    product with V saves the 2-byte cast of it; K and V are saved after ``repeat_kv`` (all ``a`` heads);
  * SwiGLU instead of a 4h GeLU MLP: the gate output (SiLU input), the SiLU output, the up output and their
    product (down_proj input), each ``2·s·b·I`` with ``I = intermediate_size``;
  * RMSNorm instead of LayerNorm: the fp32 upcast of the input (4 bytes), the 2-byte normalised value the weight
    multiplies, and a per-token fp32 ``rsqrt`` (the paper drops LayerNorm's per-token statistics as small);
  * sequence parallel as torch's DTensor runs it saves the *gathered* input of the column-parallel linears
    (Megatron saves the scattered one and gathers again in backward): those two terms are not divided by t.

The planner's estimate (``activations.py``, bf16, eager attention) must equal the adapted sum, field by field;
undoing the substitutions on the planner's own figure must give back ``34 + 5as/h`` exactly; and one real HF
Llama decoder layer must save exactly the adapted bytes (``saved_tensors_hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hf_dist.planner import Workload, make_layout, model_spec
from hf_dist.planner.activations import activation_model
from hf_dist.planner.measure import SavedTensorBytes


@dataclass(frozen=True)
class Shape:
    s: int
    b: int
    h: int
    a: int
    i: int  # Llama's intermediate_size (the paper's MLP is 4h)


@dataclass(frozen=True)
class Term:
    """One saved tensor: its bytes, whether TP divides it, whether SP divides it, and the planner field."""

    bytes: int
    tp: bool
    sp: bool
    field: str

    def per_rank(self, t: int, sp: bool) -> float:
        return self.bytes / t if self.tp or (sp and self.sp) else self.bytes


def korthikanti(x: Shape) -> dict[str, Term]:
    """Section 4.1 of the paper, 16-bit activations, one layer."""
    sbh, as2b = x.s * x.b * x.h, x.a * x.s * x.s * x.b
    return {
        # attention block: 11·sbh + 5·as²b
        "qkv_input": Term(2 * sbh, False, True, "linear_inputs"),
        "q_and_k": Term(4 * sbh, True, True, "attention"),
        "softmax_output": Term(2 * as2b, True, True, "attention"),
        "softmax_dropout_mask": Term(as2b, True, True, "attention"),
        "dropout_output_for_v": Term(2 * as2b, True, True, "attention"),
        "v": Term(2 * sbh, True, True, "attention"),
        "out_proj_input": Term(2 * sbh, True, True, "attention"),
        "attention_dropout_mask": Term(sbh, False, True, "dropout"),
        # MLP: 19·sbh
        "mlp_input": Term(2 * sbh, False, True, "linear_inputs"),
        "gelu_input": Term(8 * sbh, True, True, "mlp"),
        "second_linear_input": Term(8 * sbh, True, True, "mlp"),
        "mlp_dropout_mask": Term(sbh, False, True, "dropout"),
        # two LayerNorms: 4·sbh
        "layernorm_inputs": Term(4 * sbh, False, True, "norms"),
    }


def llama_terms(x: Shape) -> dict[str, Term]:
    """The same slots in the HF Llama layer (bf16, eager attention); a missing key saves nothing."""
    sbh, sbi, as2b, sb = x.s * x.b * x.h, x.s * x.b * x.i, x.a * x.s * x.s * x.b, x.s * x.b
    return {
        "qkv_input": Term(2 * sbh, False, False, "linear_inputs"),  # gathered under DTensor SP
        "q_and_k": Term(4 * sbh, True, True, "attention"),  # K after repeat_kv
        "softmax_output": Term(4 * as2b, True, True, "attention"),  # fp32 softmax
        "dropout_output_for_v": Term(2 * as2b, True, True, "attention"),  # the bf16 cast of the probabilities
        "v": Term(2 * sbh, True, True, "attention"),  # after repeat_kv
        "out_proj_input": Term(2 * sbh, True, True, "attention"),
        "mlp_input": Term(2 * sbh, False, False, "linear_inputs"),  # gathered under DTensor SP
        "gelu_input": Term(2 * sbi, True, True, "mlp"),  # gate output = SiLU input
        "second_linear_input": Term(2 * sbi, True, True, "mlp"),  # gate x up = down_proj input
        "silu_output": Term(2 * sbi, True, True, "mlp"),
        "up_output": Term(2 * sbi, True, True, "mlp"),
        "layernorm_inputs": Term(2 * 6 * sbh, False, True, "norms"),  # fp32 upcast + bf16 normalised, twice
        "rmsnorm_rsqrt": Term(2 * 4 * sb, False, True, "norms"),
    }


def _total(terms: dict[str, Term], t: int = 1, sp: bool = False) -> float:
    return sum(term.per_rank(t, sp) for term in terms.values())


def _planner_layer(x: Shape, t: int = 1, sp: bool = False):
    from hf_dist.models.tiny import tiny_llama_config

    config = tiny_llama_config(hidden_size=x.h, num_attention_heads=x.a, num_key_value_heads=x.a,
                               intermediate_size=x.i, num_hidden_layers=2, vocab_size=256)
    workload = Workload(seq_len=x.s, micro_batch_size=x.b, precision="bf16_mixed", attention="eager")
    return config, activation_model(model_spec(config), workload,
                                    make_layout("ddp", t, tp=t, sequence_parallel=sp)).layer


# GPT-3 175B's layer (the paper's table 3 shape) and two non-default small ones
SHAPES = [Shape(s=2048, b=1, h=12288, a=96, i=49152), Shape(s=48, b=3, h=96, a=6, i=160),
          Shape(s=32, b=2, h=64, a=4, i=96)]


@pytest.mark.parametrize("x", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 4])
def test_the_term_by_term_accounting_is_korthikantis_formula(x, t):
    terms = korthikanti(x)
    sbh, r = x.s * x.b * x.h, x.a * x.s / x.h
    assert _total(terms) == sbh * 34 + 5 * x.a * x.s * x.s * x.b  # sbh(34 + 5as/h), in integers
    assert _total(terms, t) == pytest.approx(sbh * (10 + 24 / t + 5 * r / t), rel=1e-12)
    assert _total(terms, t, sp=True) == pytest.approx(sbh * (34 + 5 * r) / t, rel=1e-12)


@pytest.mark.parametrize("x", SHAPES)
@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True)])
def test_planner_layer_equals_the_adapted_formula_field_by_field(x, t, sp):
    if x.a % t or x.i % t:
        pytest.skip("shape does not split")
    _, layer = _planner_layer(x, t, sp)
    adapted = llama_terms(x)
    for field in ("norms", "linear_inputs", "attention", "mlp"):
        expected = sum(term.per_rank(t, sp) for term in adapted.values() if term.field == field)
        assert getattr(layer, field) == expected, field
    assert layer.weight_casts == layer.lora == 0
    assert layer.total == _total(adapted, t, sp)


@pytest.mark.parametrize("x", SHAPES)
def test_restoring_the_gpt_terms_on_the_planners_figure_gives_34_plus_5as_over_h(x):
    _, layer = _planner_layer(x)
    gpt, llama = korthikanti(x), llama_terms(x)
    restored = layer.total - sum(term.bytes for term in llama.values()) + sum(term.bytes for term in gpt.values())
    assert restored == x.s * x.b * x.h * 34 + 5 * x.a * x.s * x.s * x.b
    # and the substitutions are the ones the docstring names, nothing else
    assert set(gpt) - set(llama) == {"softmax_dropout_mask", "attention_dropout_mask", "mlp_dropout_mask"}
    assert set(llama) - set(gpt) == {"silu_output", "up_output", "rmsnorm_rsqrt"}


def test_one_hf_llama_layer_saves_exactly_the_adapted_bytes():
    x = SHAPES[1]
    config, layer_model = _planner_layer(x)
    config._attn_implementation = "eager"
    from hf_dist.models.tiny import build_tiny_model

    model = build_tiny_model(config, dtype=torch.bfloat16).train()
    layer = model.model.layers[0]
    hidden = torch.randn(x.b, x.s, x.h, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(x.s)[None].expand(x.b, x.s)
    cos, sin = model.model.rotary_emb(hidden, positions)
    mask = torch.full((x.s, x.s), float("-inf")).triu(1).to(torch.bfloat16)[None, None].expand(x.b, 1, x.s, x.s)
    with SavedTensorBytes(layer) as saved:
        layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
    rope = cos.numel() * cos.element_size() + sin.numel() * sin.element_size()  # the planner's rope_tables term
    assert saved.nbytes - rope == layer_model.total == _total(llama_terms(x))

"""Activation memory of a gated-MLP decoder (HF Llama/Mistral/Qwen2 modelling code), per rank, in bytes.

Each term is a tensor autograd saves for backward in the HF forward, counted once per storage. With
``N = micro_batch x seq_len`` tokens, ``r`` the residual-stream bytes, ``c`` the matmul I/O bytes, ``t`` the TP
degree, one layer saves:

  * each of its two RMSNorms: the fp32 input (``pow``), the fp32 normalised value (``weight * x``; with a bf16
    residual the norm saves an fp32 copy and a bf16 output instead) and a per-token ``rsqrt``:
    ``(4 + r)·N·h + 4·N``; a frozen norm weight (LoRA) saves only ``4·N·h + 4·N``;
  * the input of the column-parallel linears: once (``c·N·h``) when the module computes in its own dtype, but
    once per linear under autocast, which casts the fp32 input separately for q, k, v (3x) and gate, up (2x);
  * attention: SDPA/flash keeps q, k, v, the output (``c·N·(2·q_dim + 2·kv_dim)/t``; the output is also the
    o_proj input) and an fp32 logsumexp ``4·b·heads·s/t``; eager keeps q and k, v repeated to all heads, the
    fp32 softmax probabilities (``4·b·heads·s²/t``, plus their ``c``-byte copy when c = 2) and the o_proj input;
  * the MLP: gate output, SiLU output, up output and their product, ``4·c·N·I/t``;
  * under autocast, the bf16 copy of every linear weight (``c·weights/t``): autograd saves the cast, not the
    fp32 parameter;
  * with LoRA (dropout 0), each adapter's A output (``c·N·rank`` per linear). PEFT keeps adapters in fp32: on
    a bf16 base each adapter saves its own fp32 copy of its input (``4·N·(5·h + q_dim + I)``), its A output in
    fp32, and the frozen down_proj no longer keeps the MLP product (``3·c·N·I/t``).
A MoE layer (``ModelSpec.is_moe``; transformers' experts forward, each expert a gated MLP over the tokens
routed to it) replaces the MLP terms: the router keeps its c-byte logits and fp32 probabilities (``(c + 4)·N·E``);
the routing ids and weights (top-k ids, sort, permutation and scatter indices, ``(32 + c)·N·k``) and the per-expert
offsets; the N·k routed token copies keep each expert's input, gate/up output, activation, product and down output
(``c·N·k·(2·h + 4·I_e)``); under autocast the router's and the local experts' (``E / ep``) weight casts.
Qwen3-MoE's per-head q/k RMSNorms add ``(4 + r)·N·(q_dim + kv_dim)`` and their rsqrt. One real Qwen3-MoE layer
saves these bytes within 1 % (``tests/test_planner_moe.py``). Under expert parallelism the token exchange's send
and receive buffers (``2·c·N·k·h``) join the gradient working set. Routing is assumed balanced: a rank whose
experts draw more than ``N·k`` copies holds proportionally more. The router logits every layer returns when
``output_router_logits=True`` (``L·N·E·c``, for the aux loss) are not counted.
With activation checkpointing a layer keeps only its input, ``r·N·h`` (divided by t with sequence parallel),
and during backward one layer is recomputed and holds the full set above.

The head keeps the final norm, the lm_head input (``c·N·h``; not kept when lm_head is frozen), under autocast
the lm_head weight cast, the fp32 log-softmax output ``4·N·V`` and the labels. Backward of the loss holds two
more fp32 ``N x V`` tensors at once (the incoming gradient and the log-softmax input gradient): ``8·N·V``.
With the chunked loss (``Workload.chunked_loss``, ``hf_dist.loss.chunked``) no ``N x V`` tensor exists: the loss
keeps the head weight's fp32 gradient ``4·V·h`` (made in forward) and the labels; one chunk of ``g`` tokens
(``chunk_tokens_for(V, h)``, at least h) holds its logits ``c·g·V`` (overwritten with their gradient), and one
piece of ``k`` of them (``piece_tokens_for(V)``) its fp32 copy and the log-sum-exp's fp32 temporary, ``k·V·8``
bytes (``k·V·4`` for fp32 logits, worked on in place: the gradient is written in closed form), then the chunk's
product for the head's gradient (``c·V·h``) before it is added into the fp32 sum; the lm_head input term
stands for the hidden states' gradient the loss keeps instead (the same ``c·N·h``). Its backward multiplies the kept
gradients by the incoming one, making new ones (``4·V·h + c·N·h``) while the kept ones are still held.
With TP the logits are gathered to the full vocabulary (HF ``colwise_gather_output``), so these are not split,
except with vocabulary parallelism, where the model returns vocab-sharded logits and the loss runs under
``loss_parallel``: every ``N x V`` term is then ``N x V/t``. The lm_head weight cast is split where TP splits the
head (``states.lm_head_tp``).

The gradient working set while a layer runs backward is counted as two residual-stream gradients
(``2·r·N·h``) and the larger of two MLP-intermediate gradients (``2·c·N·I/t``, the largest live at once in the
MLP backward) and, with eager attention, the softmax backward's two fp32 ``(b, heads, s, s)`` gradients (the
incoming one upcast from the probabilities' dtype and the scores' gradient it produces, ``8·b·heads·s²/t``). Sequence parallel splits norm and residual terms by t; linear inputs stay full (torch's DTensor
sequence parallel all-gathers before the column-parallel linears, and they save the gathered input).

Context parallelism (``cp``) splits every sequence over cp ranks: a rank holds ``N/cp`` tokens of every per-token
term above, and its attention runs the whole sequence for ``heads/cp`` heads after the all-to-all (eager
probabilities and their gradients ``b·heads·s²/cp``); the model's mask and rotary tables stay whole-sequence.

Against Korthikanti et al.'s ``s·b·h·(34 + 5·a·s/h)`` (a GPT layer with dropout and a 4h GeLU MLP) these terms
are that accounting with the Llama substitutions (no dropout masks, fp32 softmax, SwiGLU, RMSNorm, DTensor SP
saving gathered linear inputs): ``tests/test_planner_korthikanti.py`` derives both and checks them.

Not here: parameters, gradients, optimizer states or buffers (``memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hf_dist.loss.policy import chunk_tokens_for, piece_tokens_for
from hf_dist.planner.catalogue import ModelSpec
from hf_dist.planner.workload import Layout, Workload
from hf_dist.planner.states import lm_head_tp
from hf_dist.precision import itemsize, tensor_dtypes


@dataclass(kw_only=True, frozen=True)
class LayerActivations:
    """Bytes one decoder layer saves for backward (one micro batch, one rank), by term."""

    norms: int
    """The two RMSNorms' saved inputs, normalised values and rsqrt."""
    linear_inputs: int
    """Inputs of q/k/v and gate/up (autocast casts them once per linear)."""
    attention: int
    """q, k, v, output and logsumexp (SDPA) or probabilities (eager)."""
    mlp: int
    """Gate, SiLU, up and product tensors."""
    weight_casts: int
    """bf16 copies of the linear weights saved under autocast."""
    lora: int
    """LoRA A outputs."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(kw_only=True, frozen=True)
class ActivationModel:
    """The activation terms of one rank for one micro batch."""

    layer: LayerActivations
    """One decoder layer without checkpointing."""
    checkpoint_input: int
    """What a checkpointed layer keeps: its input."""
    rope_tables: int
    """cos/sin tables, saved once (shared by all layers) when layers are not checkpointed."""
    embedding_ids: int
    """Input ids kept by the embedding."""
    head: int
    """Final norm, lm_head input and (autocast) lm_head weight cast."""
    loss: int
    """fp32 log-softmax output and the labels."""
    loss_backward: int
    """Extra fp32 N x V gradients alive during the loss backward."""
    logits_forward: int
    """Logits alive while the loss is computed in forward: the c-byte logits and their fp32 upcast."""
    grad_working_set: int
    """Activation gradients alive while one layer runs backward."""
    attention_mask: int
    """The (b, 1, s, s) additive mask eager attention builds (0 for SDPA/flash with causal masking)."""
    largest_layer_tensor: int = 0
    """The largest single activation tensor of a layer (an MLP intermediate, or eager's score matrix)."""

    def largest_tensor(self, *, last: bool) -> int:
        """The largest single activation allocation on a rank (the last stage also holds fp32 N x V logits)."""
        return max(self.largest_layer_tensor, self.loss_backward // 2 if last else 0)

    def saved_after_forward(self, *, layers: int, checkpointing: bool, first_stage: bool = True,
                            last_stage: bool = True) -> int:
        """Bytes saved for backward once forward ends (what ``saved_tensors_hooks`` counts)."""
        per_layer = self.checkpoint_input if checkpointing else self.layer.total
        total = layers * per_layer + (0 if checkpointing else self.rope_tables)
        if first_stage:
            total += self.embedding_ids
        if last_stage:
            total += self.head + self.loss
        return total


def dtype_bytes(workload: Workload, layout: Layout) -> tuple[int, int, bool]:
    """``(residual bytes, matmul bytes, autocast)`` of the forward.

    LoRA on a bf16 precision keeps the frozen base in bf16, so the model computes in bf16 and autocast has
    nothing to cast (the adapters' casts are negligible).
    """
    if workload.precision != "fp32" and layout.lora_rank:
        return 2, 2, False
    dtypes = tensor_dtypes(layout, workload.precision)
    residual, matmuls = itemsize(dtypes.residual), itemsize(dtypes.matmuls)
    return residual, matmuls, residual != matmuls


def _layer(model: ModelSpec, workload: Workload, layout: Layout) -> LayerActivations:
    r, c, autocast = dtype_bytes(workload, layout)
    cp = layout.dims.cp
    n, h, t = workload.tokens // cp, model.hidden_size, layout.dims.tp
    sp = t if layout.sequence_parallel else 1
    heads_s = workload.micro_batch_size * model.num_attention_heads * workload.seq_len // cp  # local tokens or heads
    norm = (4 * n * h if layout.lora_rank else (4 + r) * n * h) + 4 * n
    if workload.attention == "eager":
        probabilities = (4 if c == 4 else 6) * heads_s * workload.seq_len
        attention = (4 * c * n * model.q_dim + probabilities) // t
    else:
        attention = (c * n * (2 * model.q_dim + 2 * model.kv_dim) + 4 * heads_s) // t
    if model.shape.qk_norm:  # per-head RMSNorm of q and k: fp32 input, normalised value, rsqrt
        attention += ((4 + r) * n * (model.q_dim + model.kv_dim)
                      + 4 * workload.micro_batch_size * workload.seq_len * (
                          model.num_attention_heads + model.num_key_value_heads)) // t
    inputs, mlp, lora = (5 if autocast else 2) * c * n * h, 4 * c * n * model.intermediate_size // t, c
    casts = model.layer_linear_weights // t
    if model.is_moe:  # routed experts: N·k token copies through gate_up and down (TP never splits experts)
        k, e, w = model.experts_per_token, model.num_experts, model.moe_intermediate_size
        inputs = (4 if autocast else 2) * c * n * h  # q, k, v casts and the router's; or attention + router input
        mlp = c * n * k * (2 * h + 4 * w) + 4 * n * e + c * n * e + (32 + c) * n * k + 4 * e
        casts = model.layer_linear_weights + e * h + model.layer_expert_weights // layout.ep
    if layout.lora_rank and c != 4 and model.is_moe:  # adapters on attention only: fp32 copies of their inputs
        inputs, lora = 4 * n * (3 * h + model.q_dim) + c * n * h, 4
    elif layout.lora_rank and c != 4:
        # fp32 adapters on a bf16 base: every adapter saves its own fp32 copy of its input, and the frozen
        # down_proj no longer keeps the bf16 gate x up product
        inputs = 4 * n * (5 * h + (model.q_dim + model.intermediate_size) // t)
        mlp, lora = 3 * c * n * model.intermediate_size // t, 4
    return LayerActivations(
        norms=2 * norm // sp,
        linear_inputs=inputs,
        attention=attention,
        mlp=mlp,
        weight_casts=c * casts if autocast else 0,
        lora=len(model.linear_shapes()) * lora * n * layout.lora_rank,
    )


def _whole_loss_terms(n: int, v: int, c: int) -> dict[str, int]:
    """The model's own loss: fp32 ``N x V`` log-softmax saved, logits and their upcast, two fp32 gradients."""
    return dict(loss=4 * n * v + 8 * n, loss_backward=8 * n * v, logits_forward=c * n * v + (4 * n * v if c != 4 else 0))


def _chunked_loss_terms(n: int, h: int, v: int, c: int) -> dict[str, int]:
    """``hf_dist.loss``: the head weight's fp32 gradient and the labels kept; one chunk's logits at a time (in the
    compute dtype, overwritten with their gradient), going through the fp32 cross-entropy one piece at a time."""
    g = min(n, chunk_tokens_for(v, h))
    k = min(g, piece_tokens_for(v))
    # the closed-form gradient (``chunked._piece_loss_into_grad``) works on a compute-dtype piece's fp32 copy (an
    # fp32 piece in place) beside the log-sum-exp's one fp32 temporary: 8 bytes a logit, 4 for fp32 (measured on CPU,
    # ``tests/test_planner_peak.py``; a model's logit transform goes through autograd, a little more, not counted)
    piece = 4 * k * v + (4 * k * v if c != 4 else 0)
    # backward scales the kept gradients by the incoming one: a new fp32 head gradient and hidden-state gradient
    # while the kept ones are still held
    # after its pieces, a chunk's product for the head's gradient (``[V, h]`` in the compute dtype) is made before it
    # is added into the fp32 sum
    return dict(loss=4 * v * h + 8 * n, loss_backward=4 * v * h + c * n * h,
                logits_forward=g * v * c + max(piece, c * v * h))


def activation_model(model: ModelSpec, workload: Workload, layout: Layout) -> ActivationModel:
    """All activation terms of ``model`` under ``workload`` on one rank of ``layout``."""
    r, c, autocast = dtype_bytes(workload, layout)
    cp = layout.dims.cp
    n, h, v, t = workload.tokens // cp, model.hidden_size, model.vocab_size, layout.dims.tp
    sp = t if layout.sequence_parallel else 1
    v = v // t if layout.vocab_parallel else v  # the logits columns a rank holds
    chunked = workload.chunked_loss and not layout.vocab_parallel
    final_norm = (4 * n * h if layout.lora_rank else (4 + r) * n * h) + 4 * n
    lm_head_input = 0 if layout.lora_rank else c * n * h
    lm_head_cast = c * model.vocab_size * h // lm_head_tp(model, t, layout.vocab_parallel) if autocast else 0
    mask = r * workload.micro_batch_size * workload.seq_len**2 if workload.attention == "eager" else 0
    # eager softmax backward: the fp32 gradient of the probabilities and the fp32 gradient of the scores
    eager_grads = 8 * workload.micro_batch_size * model.num_attention_heads * workload.seq_len**2 // cp if (
        workload.attention == "eager") else 0
    # a MoE layer's widest tensors are its N·k routed copies; under EP one exchange (dispatch or combine, forward
    # or backward) holds its send and receive buffers of N·k token copies each (balanced routing assumed)
    mlp_width = model.experts_per_token * model.moe_intermediate_size if model.is_moe else model.intermediate_size
    all_to_all = 2 * c * n * model.experts_per_token * h if model.is_moe and layout.ep > 1 else 0
    return ActivationModel(
        layer=_layer(model, workload, layout),
        checkpoint_input=r * n * h // sp,
        rope_tables=2 * workload.seq_len * model.head_dim * r,
        embedding_ids=8 * n,
        head=final_norm // sp + lm_head_input + lm_head_cast,
        **(_chunked_loss_terms(n, h, v, c) if chunked else _whole_loss_terms(n, v, c)),
        grad_working_set=2 * r * n * h // sp + max(2 * c * n * mlp_width, eager_grads) // t + all_to_all,
        attention_mask=mask,
        largest_layer_tensor=max(c * n * mlp_width * (2 if model.is_moe else 1), eager_grads // 2) // t,
    )

"""The chunked loss (``hf_dist.loss``) against the model's own loss: values, gradients, memory, and DistTrainer.

Pure cases run the model's own forward both ways in one process (models with logit soft-capping, scaling, and a
MoE router aux loss included); the trainer cases train 3 steps with the chunked loss in one process and on 2 gloo
ranks (DDP, FSDP2) against one process with the model's own loss.
"""

import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from parity import assert_parity
from trainer_harness import train_tiny, trainer_run

from hf_dist.loss.causal_lm import ChunkedCausalLMLoss
from hf_dist.loss.chunked import LogitTransform, linear_cross_entropy

VOCAB = 97
MODELS = {
    "llama": {"tie_word_embeddings": False},
    "gemma2": {"final_logit_softcapping": 3.0},
    "cohere": {"logit_scale": 0.37},
    "granite": {"logits_scaling": 2.5},
    "qwen3_moe": {"output_router_logits": True, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "router_aux_loss_coef": 0.3},
}


def _model(model_type: str, vocab: int = VOCAB):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  **MODELS[model_type])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _batch(seq: int = 11):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, seq), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    return ids, labels


def _loss_and_grads(model, call, **inputs):
    model.zero_grad()
    loss = call(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(MODELS))
@pytest.mark.parametrize("num_items", [None, 17])
def test_equals_the_models_own_loss_and_gradients(model_type, num_items):
    model = _model(model_type)
    ids, labels = _batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    ref_loss, ref_grads = _loss_and_grads(model, model, input_ids=ids, labels=labels, **extra)
    chunked = ChunkedCausalLMLoss(model, chunk_tokens=5)  # several chunks, the last one short
    loss, grads = _loss_and_grads(model, chunked, input_ids=ids, labels=labels, **extra)
    assert chunked.refusal is None and chunked.verified
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    if model_type == "qwen3_moe":  # the router aux loss is in it, weighted as the model weighs it
        aux = model(input_ids=ids).aux_loss.detach()
        assert model.router_aux_loss_coef * float(aux) > 1e-2  # dropping it would break the equality above


def test_under_bf16_autocast_equal_within_bf16_rounding():
    """Same loss; gradients within bf16's rounding (the model rounds ``grad / tokens`` to bf16, the chunks round
    ``grad`` and divide after the matmul in fp32)."""
    model = _model("llama")
    ids, labels = _batch(seq=40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(model, model, input_ids=ids, labels=labels)
        loss, grads = _loss_and_grads(model, ChunkedCausalLMLoss(model, chunk_tokens=7), input_ids=ids, labels=labels)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for name, grad in ref_grads.items():
        assert float((grads[name] - grad).norm() / grad.norm()) < 2 ** -6, name  # bf16 eps is 2**-8


def test_a_logit_transform_it_does_not_reproduce_falls_back_to_the_models_loss():
    model = _model("llama")
    ids, labels = _batch()
    ref_loss, _ = _loss_and_grads(model, model, input_ids=ids, labels=labels)
    chunked = ChunkedCausalLMLoss(model)
    chunked.transform = LogitTransform(multiply=2.0)  # as if the model scaled its logits some unknown way
    loss, _ = _loss_and_grads(model, chunked, input_ids=ids, labels=labels)
    assert chunked.refusal is not None and "logits" in chunked.refusal
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)


def test_degenerate_states_do_not_decide_the_verification():
    """A forward on empty buffers (a pipeline stage's shape inference) neither verifies nor refuses the transform."""
    model = _model("llama")
    ids, labels = _batch()
    chunked = ChunkedCausalLMLoss(model)
    chunked.transform = LogitTransform(multiply=2.0)  # wrong: only a forward on real states may find it out
    embeds = torch.full((*ids.shape, 32), float("nan"))
    chunked(inputs_embeds=embeds, labels=labels)
    assert not chunked.verified and chunked.refusal is None
    chunked(input_ids=ids, labels=labels)
    assert chunked.refusal is not None


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_builds_the_whole_logits_or_their_gradient():
    """The largest tensor made in forward and backward is one chunk of logits, not ``tokens x vocab``."""
    vocab = 1000  # tokens x vocab well above the head's weight (vocab x hidden) and any activation
    model = _model("llama", vocab=vocab)
    ids, labels = _batch(seq=40)
    tokens = ids.numel()
    with _LargestTensor() as whole:
        model(input_ids=ids, labels=labels).loss.backward()
    assert whole.largest >= tokens * vocab  # the probe sees the model's own whole logits
    with _LargestTensor() as chunked:
        ChunkedCausalLMLoss(model, chunk_tokens=4)(input_ids=ids, labels=labels).loss.backward()
    assert chunked.largest < tokens * vocab / 2


@pytest.mark.parametrize("transform", [LogitTransform(softcap=5.0), LogitTransform()], ids=["softcap", "identity"])
def test_pieces_inside_chunks_equal_the_whole_loss_and_one_level_chunks(transform):
    """Chunks through the head's matmuls, pieces through the fp32 cross-entropy (short last chunk and piece, ignored
    targets; a soft-cap differentiated by autograd, or none: the closed-form gradient): the whole loss's value and
    gradients in fp32; under bf16 autocast the same gradients as chunks of one piece each, bit for bit (the
    cross-entropy's gradient is row by row)."""
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(3, 11, 16), torch.randn(50, 16) / 4, torch.randn(50)
    targets = torch.randint(0, 50, (3, 11))
    targets[0, :4] = -100

    def run(loss_of, dtype=None):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_of(*leaves)
        loss.backward()
        return loss.detach(), [t.grad for t in leaves]

    whole = run(lambda h, w, b: F.cross_entropy(transform(F.linear(h, w, b)).float().flatten(0, 1),
                                                targets.flatten(), reduction="sum"))
    two_level = run(lambda h, w, b: linear_cross_entropy(h, w, b, targets, transform=transform, chunk_tokens=7,
                                                         piece_tokens=3))
    torch.testing.assert_close(two_level, whole, rtol=1e-6, atol=1e-6)
    pieces = run(lambda h, w, b: linear_cross_entropy(h, w, b, targets, transform=transform, chunk_tokens=7,
                                                      piece_tokens=3), torch.bfloat16)
    one_level = run(lambda h, w, b: linear_cross_entropy(h, w, b, targets, transform=transform, chunk_tokens=7),
                    torch.bfloat16)
    torch.testing.assert_close(pieces[1], one_level[1], rtol=0, atol=0)
    torch.testing.assert_close(pieces[0], one_level[0], rtol=1e-6, atol=1e-6)


def test_the_closed_form_gradient_is_as_close_to_float64_as_autograds():
    """Without a logit transform a piece's gradient is ``softmax - one_hot`` from one fp32 copy (in place for fp32
    logits); against a float64 reference the gradient is no further off than autograd's log-softmax backward (the
    whole loss's), and the loss within fp32's relative rounding, for fp32 and bf16 logits."""
    from hf_dist.loss.chunked import _piece_loss_into_grad

    torch.manual_seed(0)
    logits64, targets = torch.randn(64, 3000, dtype=torch.float64) * 4, torch.randint(0, 3000, (64,))
    for dtype in (torch.float32, torch.bfloat16):
        logits = logits64.to(dtype)
        ref_loss = F.cross_entropy(logits.double(), targets, reduction="sum")  # of the logits as rounded
        ref_grad = torch.softmax(logits.double(), -1) - F.one_hot(targets, 3000).double()
        leaf = logits.detach().requires_grad_()
        their_loss = F.cross_entropy(leaf.float(), targets, reduction="sum")
        their_loss.backward()
        piece = logits.clone()
        our_loss = _piece_loss_into_grad(piece, targets, LogitTransform())
        ours_err, theirs_err = ((x.double() - ref_grad).abs().max().item() for x in (piece, leaf.grad))
        assert ours_err <= theirs_err, (dtype, ours_err, theirs_err)
        # the loss: each row's log-sum-exp rounded once in fp32, the rows summed in float64
        torch.testing.assert_close(our_loss.double(), ref_loss, rtol=1e-7, atol=0)


def test_refuses_bad_shapes_and_chunks():
    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="leading shape"):
        linear_cross_entropy(hidden, weight, None, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        linear_cross_entropy(hidden, weight, None, torch.zeros(2, 3, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="piece_tokens=0"):
        linear_cross_entropy(hidden, weight, None, torch.zeros(2, 3, dtype=torch.long), piece_tokens=0)


def _head_unit_grads(rank, world_size):
    """The chunked loss's loss and gradients with the untied head an FSDP2 unit of its own (one rank: every shard is
    the whole tensor, so a weight read past FSDP2's gather fails and a missing reduce-scatter leaves a gradient None).
    """
    from torch.distributed.fsdp import FSDPModule

    from hf_dist import ParallelDims, parallelize
    from hf_dist.loss.chunked import HEAD_LOSS_METHOD

    model = _model("llama")
    dims = ParallelDims(world_size=world_size, dp_shard=world_size)
    dims.build_mesh("cpu")
    parallelize(model, dims, fsdp=True)
    head = model.get_output_embeddings()
    assert isinstance(head, FSDPModule) and hasattr(head, HEAD_LOSS_METHOD) and model.model.norm.weight.ndim == 1
    ids, labels = _batch()
    chunked = ChunkedCausalLMLoss(model, chunk_tokens=5)
    loss, grads = _loss_and_grads(model, chunked, input_ids=ids, labels=labels)
    assert chunked.refusal is None and chunked.verified
    return loss, {name: grad.full_tensor() for name, grad in grads.items()}, head.weight.to_local().shape


def test_an_untied_head_as_its_own_fsdp2_unit_gets_the_same_gradients():
    """The loss runs as the head unit's registered forward method: gathered around it, its gradient reduced after."""
    model = _model("llama")
    ids, labels = _batch()
    ref_loss, ref_grads = _loss_and_grads(model, ChunkedCausalLMLoss(model, chunk_tokens=5), input_ids=ids,
                                          labels=labels)
    ((loss, grads, head_shard),) = run_distributed(_head_unit_grads, 1)
    assert head_shard == (VOCAB, 32)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


STEPS = 3


def _prefetch(trainer) -> list[tuple[int, int, bool]]:
    """Per FSDP unit below the root, in module order: (forward prefetch targets, backward prefetch targets,
    resharded after forward)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [m for m in trainer.model.modules() if isinstance(m, FSDPModule) and m is not trainer.model]
    states = [b._get_fsdp_state() for b in blocks]
    return [(len(s._states_to_forward_prefetch), len(s._states_to_backward_prefetch),
             b._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None) for b, s in zip(blocks, states)]


def _trained(**overrides):
    """``trainer_run`` (losses, norms, the first step's gradients, every parameter), whether the chunked loss ran, and
    the FSDP2 prefetch layout."""
    with tempfile.TemporaryDirectory() as out:
        run, trainer = trainer_run(out, max_steps=STEPS, global_batch_size=8, **overrides)
    used = getattr(trainer, "_chunked_loss", None)
    prefetch = _prefetch(trainer) if overrides.get("fsdp") else None
    return run, used is not None and used.refusal is None and used.verified, prefetch


FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}


def _two_ranks(rank, world_size):
    layouts = {"ddp": {}, "fsdp2": FSDP2, "fsdp2_implicit_prefetch": {**FSDP2, "fsdp2_explicit_prefetch": False}}
    return {layout: _trained(per_device_train_batch_size=2, **extra) for layout, extra in layouts.items()}


def test_dist_trainer_with_the_chunked_loss_matches_the_models_own_loss():
    """One process with the model's own loss is the reference (``parity.assert_parity``: losses, norms, the first
    step's gradients, every parameter); the chunked loss on one process, DDP and FSDP2 with explicit prefetch (the
    default) and without it equal it."""
    ref, used, _ = _trained(per_device_train_batch_size=4, chunked_loss=False)
    assert not used
    run, used, _ = _trained(per_device_train_batch_size=4)
    assert used
    assert_parity(run, ref, state_rtol=1e-5, what="chunked loss, one process")
    for rank_runs in run_distributed(_two_ranks, 2):
        # the embedding (untied: a unit of its own, as transformers' FSDP plan has it) is freed after forward; of the
        # two blocks the first prefetches the second in forward and keeps resharding, the last is kept gathered; the
        # head (untied: a unit too) stays gathered from its forward (the chunked loss) to its backward
        assert rank_runs["fsdp2"][2] == [(0, 0, True), (1, 0, True), (0, 1, False), (0, 0, False)]
        assert rank_runs["fsdp2_implicit_prefetch"][2] == [(0, 0, True), (0, 0, True), (0, 0, True), (0, 0, False)]
        for layout, (run, used, _) in rank_runs.items():
            assert used, layout
            assert_parity(run, ref, state_rtol=1e-5, what=f"chunked loss, {layout}")


def test_a_caller_asking_for_outputs_gets_the_whole_logits(tmp_path):
    """Drop-in: ``compute_loss(return_outputs=True)`` in training returns the logits the Trainer's would."""
    losses, params, trainer = train_tiny(str(tmp_path), max_steps=1)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    assert outputs.logits.shape == (*batch["input_ids"].shape, trainer.model.config.vocab_size)
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(loss.item(), abs=1e-6)


def test_the_planner_counts_one_chunk_not_the_whole_logits():
    from transformers import LlamaConfig

    from hf_dist.loss.policy import chunk_tokens_for, layout_refusal
    from hf_dist.planner import Workload, make_layout, model_spec
    from hf_dist.planner.activations import activation_model

    spec = model_spec(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                                  num_attention_heads=9, num_key_value_heads=3))
    layout = make_layout("ddp", 1)
    from hf_dist.loss.policy import piece_tokens_for

    n, v, h, g, k = 4 * 2048, 49152, 576, chunk_tokens_for(49152, 576), piece_tokens_for(49152)
    assert (g, k) == (576, 341)  # a chunk of at least hidden_size tokens, pieces of about 16M logits
    whole = activation_model(spec, Workload(seq_len=2048, micro_batch_size=4, precision="fp32"), layout)
    chunked = activation_model(spec, Workload(seq_len=2048, micro_batch_size=4, precision="fp32", chunked_loss=True),
                               layout)
    assert (whole.loss, whole.loss_backward, whole.logits_forward) == (4 * n * v + 8 * n, 8 * n * v, 4 * n * v)
    # backward scales the kept head and hidden-state gradients into new ones (the pieces' gradients were made in
    # forward); in forward the chunk's [V, h] product outweighs an fp32 piece's one temporary (worked in place) here
    assert (chunked.loss, chunked.loss_backward, chunked.logits_forward) == (
        4 * v * h + 8 * n, 4 * v * h + 4 * n * h, 4 * g * v + max(4 * k * v, 4 * v * h))
    assert 4 * v * h > 4 * k * v
    assert layout_refusal(layout) is None
    assert "tensor" in layout_refusal(make_layout("ddp", 2, tp=2))
    assert layout_refusal(make_layout("ddp", 2, pp=2)) is None  # the last stage computes it (test_pp_chunked_loss)
    assert "tensor" in layout_refusal(make_layout("ddp", 4, pp=2, tp=2))
    assert "DeepSpeed" in layout_refusal(make_layout("zero3", 2))

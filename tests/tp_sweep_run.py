"""One rank of the TP coverage sweep: for each model type, TP over all ranks against one process.

``sweep_rank`` builds each tiny config (``parity.tiny_config``: ``tp_sweep_cases``' values), checks it before touching anything
(``check_tp_sizes``: a refusal is recorded with its message), then trains the reference and the
tensor-parallel model side by side for ``STEPS`` SGD steps on the same batch and records the largest
difference of losses, logits and gradients (every step). Imported by ``test_tp_sweep.py`` (spawned ranks).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from parity import full_grads, tiny_config
from tp_sweep_cases import SEQ

STEPS = 3
LR = 0.1
BATCH = 2


def _max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"gradient keys differ: {sorted(a.keys() ^ b.keys())}")
    if os.environ.get("HF_DIST_SWEEP_DEBUG"):
        worst = max(a, key=lambda k: float((a[k] - b[k]).abs().max()))
        print("worst grad", worst, float((a[worst] - b[worst]).abs().max()), float(a[worst].abs().max()), flush=True)
    # relative to the gradient's scale where it is above 1 (fp32 rounding of a partial sum grows with it)
    return max(float((a[k] - b[k]).abs().max()) / max(1.0, float(b[k].abs().max())) for k in a) if a else 0.0


def _build(config, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def compare(model_type: str, tp_mesh) -> dict:
    """``{"refused": msg}`` or ``{"loss", "logits", "grads"}`` max differences over ``STEPS`` steps."""
    from hf_dist.tensor_parallel import apply_tensor_parallel, check_tp_sizes

    config = tiny_config(model_type, "tp")
    try:
        check_tp_sizes(config, tp_mesh.size())
    except ValueError as err:
        return {"refused": str(err)}
    reference, model = _build(config, 0), _build(config, 0)
    apply_tensor_parallel(model, tp_mesh)
    batch = torch.randint(3, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    # SGD: an update linear in the gradient (Adam's normalisation turns rounding in near-zero gradients into
    # lr-sized parameter differences, which would hide real errors behind noise)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (reference, model)]
    diffs = {"loss": 0.0, "logits": 0.0, "grads": 0.0}
    for _ in range(STEPS):
        outs = [m(input_ids=batch, labels=batch) for m in (reference, model)]
        for out in outs:
            out.loss.backward()
        diffs["loss"] = max(diffs["loss"], abs(outs[0].loss.item() - outs[1].loss.item()))
        diffs["logits"] = max(diffs["logits"], float((outs[0].logits - outs[1].logits).detach().abs().max()))
        diffs["grads"] = max(diffs["grads"], _max_diff(full_grads(reference), full_grads(model)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return diffs


def trainer_refusal(output_dir: str) -> str:
    """What ``DistTrainer(tp_size=world)`` says for a model type without a plan (XGLM), and the proof that
    it said so before touching the model."""
    from transformers import AutoModelForCausalLM, XGLMConfig

    from hf_dist import DistTrainer, DistTrainingArguments

    config = XGLMConfig(d_model=32, num_layers=1, attention_heads=2, vocab_size=64, ffn_dim=64)
    model = AutoModelForCausalLM.from_config(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = DistTrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, global_batch_size=2, tp_size=dist.get_world_size(),
        use_cpu=True, report_to=[],
    )
    try:
        DistTrainer(model=model, args=args)
    except ValueError as err:
        untouched = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        return f"{err} [model untouched: {untouched}]"
    return "accepted"


def sweep_rank(rank: int, world_size: int, model_types: list[str], output_dir: str) -> dict[str, dict]:
    """Run ``compare`` for every model type on this rank; an exception is recorded, not raised."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    for model_type in model_types:
        try:
            results[model_type] = compare(model_type, tp_mesh)
        except Exception:  # noqa: BLE001 - one architecture's crash is that architecture's result
            results[model_type] = {"error": traceback.format_exc(limit=-6)}
            dist.barrier()  # the other rank may have failed elsewhere; realign before the next type
    results["trainer_refusal"] = {"message": trainer_refusal(output_dir)}
    return results

"""One rank of the TP coverage sweep: for each model type, TP over all ranks against one process, through the parity
harness (``parity``).

``compare`` builds each type's tiny config (``parity.tiny_config(case, "tp")``: ``tp_sweep_cases``' non-default
values), checks it before touching anything (``check_tp_sizes``: a refusal is recorded with its message), loads the
model from disk as users do (``parity.tiny_model(..., loaded=True)``), and trains it twice on fresh, right-padded rows
every step (``parity.masked_batches``, labels ``-100`` on the padding) with ``parity.TP_SGD`` (plain SGD, clipping
active on every step): in this process (``reference_run``) and sharded over the ranks by ``apply_tensor_parallel``
(``layout_run``). ``assert_parity`` compares losses, gradient norms, the first step's gradients and every parameter
after the steps within 1e-5. Imported by ``test_tp_sweep.py`` (spawned ranks), which asserts on what ``sweep_rank``
returns.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist

from parity import TP_SGD, assert_parity, layout_run, masked_batches, reference_run, tiny_config, tiny_model
from tp_sweep_cases import SEQ

STEPS = 3


def compare(case: str, tp_mesh) -> dict | str | None:
    """``{"refused": msg}`` when ``check_tp_sizes`` refuses ``case``; else None when TP equals one process, or the
    message of the assertion that failed (``assert_parity``'s, or clipping not active on every step)."""
    from hf_dist.tensor_parallel import apply_tensor_parallel, check_tp_sizes

    config = tiny_config(case, "tp")
    try:
        check_tp_sizes(config, tp_mesh.size())
    except ValueError as err:
        return {"refused": str(err)}
    steps = masked_batches(config.vocab_size, SEQ, STEPS)
    model = tiny_model(config, loaded=True)
    # one build and load for both sides: building is most of a case's time, a copy little
    ref = reference_run(copy.deepcopy(model), [[batch] for batch in steps], TP_SGD, grads=True)
    run = layout_run(apply_tensor_parallel(model, tp_mesh), steps, TP_SGD, grads=True)
    try:  # after the collectives: a mismatch leaves the ranks aligned for the next case
        # clipping active: the norm over every shard decides each update
        assert min(ref["norms"]) > TP_SGD.max_norm, f"{case}: clipping inactive, norms {ref['norms']}"
        assert_parity(run, ref, config=config, what=case)
    except AssertionError as err:
        return str(err)
    return None


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


def sweep_rank(rank: int, world_size: int, cases: list[str], output_dir: str) -> dict:
    """``compare`` for every case on this rank: None (equal), ``{"refused": msg}``, or a string (the assertion's
    message, or the traceback of a crash); then ``"trainer_refusal"``. One case's failure is its result, not raised."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results: dict = {}
    for case in cases:
        try:
            results[case] = compare(case, tp_mesh)
        except Exception:  # noqa: BLE001 - one architecture's crash is that architecture's result
            results[case] = traceback.format_exc(limit=-6)
            dist.barrier()  # the other rank may have failed elsewhere; realign before the next type
    results["trainer_refusal"] = {"message": trainer_refusal(output_dir)}
    return results

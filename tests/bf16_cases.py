"""bf16 per layout: each layout trained with ``bf16=True`` on 2 gloo ranks, and the one-process runs it is judged
against (importable by spawned ranks; ``tests/test_bf16_layouts.py`` asserts, ``bench/bf16.py`` prints the table).

Every run trains ``STEPS`` optimizer steps of plain SGD with momentum (``optim="sgd"``: an update proportional to
the gradient, so a wrong or less precise gradient shows in the parameters; Adam would turn any gradient into
learning-rate-sized steps) on the same global batch of 4 rows, and measures its last step with the step ledger
(``hf_dist.metrics.ledger.attach_ledger``): the dtypes of the parameters, gradients, optimizer states, the loss, every
matmul's operands and every collective's payload.

Models, loaded from disk as users load theirs (``trainer_harness.as_loaded``): the tiny Llama (hidden 64, 2 layers,
vocab 256) and, for EP, the parity harness's tiny Qwen3-MoE (``parity.tiny_config``: 4 experts, top-3, router aux
loss on). ``pure_bf16`` cases load the model in bf16 (no fp32 copy anywhere); the pipeline needs that, since its
stages do not autocast.
ZeRO runs DeepSpeed's engine with ``ds_configs/zero{2,3}.json`` as ``accelerate launch`` would; its fp32 master is
made from the module after DeepSpeed casts it to bf16, so its parameters are compared from that start.
"""

from __future__ import annotations

STEPS = 3
GLOBAL_BATCH = 4
MICRO = 2
LR = 0.1

LAYOUTS: dict[str, tuple[dict, str, str]] = {
    "ddp": ({}, "llama", "bf16"),
    "ddp_pure": ({}, "llama", "pure_bf16"),
    "fsdp2": ({"fsdp2": True}, "llama", "bf16"),
    "fsdp2_pure": ({"fsdp2": True}, "llama", "pure_bf16"),
    "tp": ({"tp_size": 2}, "llama", "bf16"),
    "tp_sp": ({"tp_size": 2, "tp_sequence_parallel": True}, "llama", "bf16"),
    "pp": ({"pp_size": 2}, "llama", "pure_bf16"),
    "cp": ({"cp_size": 2}, "llama", "bf16"),
    "ep_fsdp2": ({"ep_size": 2, "fsdp2": True}, "qwen3_moe", "bf16"),
    "zero2": ({"deepspeed_stage": 2}, "llama", "bf16"),
    "zero3": ({"deepspeed_stage": 3}, "llama", "bf16"),
}
"""layout -> (DistTrainingArguments overrides on 2 ranks, model, what the user asks for: ``bf16`` is ``bf16=True``
on an fp32 model, ``pure_bf16`` is ``bf16=True`` on a model loaded in bf16)"""
LABELS = {"ddp": "DDP", "ddp_pure": "DDP pure_bf16", "fsdp2": "FSDP2", "fsdp2_pure": "FSDP2 pure_bf16",
          "tp": "TP=2", "tp_sp": "TP=2+SP", "pp": "PP=2", "cp": "CP=2", "ep_fsdp2": "EP=2 x FSDP2", "zero2": "ZeRO-2",
          "zero3": "ZeRO-3"}


def model(name: str, dtype):
    from trainer_harness import VOCAB, as_loaded

    from hf_dist.models import build_tiny_model

    if name == "qwen3_moe":
        from parity import tiny_config, tiny_model

        config = tiny_config("qwen3_moe", "ep")  # the parity harness's EP case
        config.vocab_size = VOCAB
        built = tiny_model(config)
    else:
        built = build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    return as_loaded(built.to(dtype))


def train(output_dir: str, name: str, precision: str, *, where: bool = False, deepspeed_stage: int = 0,
          **overrides) -> dict:
    """One run: ``precision`` is ``fp32``, ``bf16`` or ``pure_bf16``; returns losses, full parameters, the measured
    step's ledger and the layout the run resolved. ``deepspeed_stage``: as ``accelerate launch --config_file
    accelerate_configs/zero{stage}.yaml`` would (its environment, for this run only)."""
    import os

    if not deepspeed_stage:
        return _train(output_dir, name, precision, where=where, **overrides)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launch = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "bf16" if precision != "fp32" else "no",
              "ACCELERATE_DEEPSPEED_CONFIG_FILE": os.path.join(repo, "ds_configs", f"zero{deepspeed_stage}.json"),
              "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}
    before = {k: os.environ.get(k) for k in launch}
    os.environ.update(launch)
    try:  # the Trainer refuses bf16 without a GPU unless use_cpu; accelerate still sees the gloo group
        return _train(output_dir, name, precision, where=where, use_cpu=True, **overrides)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _train(output_dir: str, name: str, precision: str, *, where: bool, **overrides) -> dict:
    import os

    import torch
    from trainer_harness import full_parameters, token_dataset

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.metrics.ledger import attach_ledger

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # before the arguments: under ZeRO-3 they make from_pretrained partition the model as it loads
    net = model(name, torch.bfloat16 if precision == "pure_bf16" else torch.float32)
    initial = {k: v.detach().float().clone() for k, v in net.state_dict().items()}
    args = DistTrainingArguments(**{
        "output_dir": output_dir, "max_steps": STEPS, "per_device_train_batch_size": MICRO,
        "global_batch_size": GLOBAL_BATCH, "optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": LR,
        "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no", "report_to": [], "seed": 0,
        "data_seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0, "max_grad_norm": 1.0,
        "bf16": precision != "fp32", "use_cpu": not torch.cuda.is_available() and world == 1, **overrides})
    trainer = DistTrainer(model=net, args=args, train_dataset=token_dataset())
    callback = attach_ledger(trainer, STEPS, where=where)
    if trainer.is_deepspeed_enabled:  # its fp32 master is made from the module it casts to bf16 first
        trainer.add_callback(_MasterAtStart(trainer, initial))
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    params = _deepspeed_master(trainer) if trainer.is_deepspeed_enabled else full_parameters(trainer)
    params = {k: v.float() for k, v in params.items()}
    return {"losses": losses, "params": params, "initial": initial, "ledger": callback.ledger.plain(),
            "layout": trainer.args.layout}


class _MasterAtStart:
    """Replaces ``initial`` with DeepSpeed's fp32 master as training begins (what its training starts from)."""

    def __init__(self, trainer, initial: dict):
        self.trainer, self.initial = trainer, initial

    def on_train_begin(self, *args, **kwargs):
        self.initial.update({k: v.float() for k, v in _deepspeed_master(self.trainer).items()})

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def _deepspeed_master(trainer) -> dict:
    """The fp32 master weights DeepSpeed's optimizer holds, gathered (the module's own are their bf16 copies)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = trainer.model_wrapped.module
    return {name: safe_get_full_fp32_param(p).detach().cpu().clone() for name, p in module.named_parameters()}


def ranks(rank: int, world_size: int, layouts: list[str], output_dir: str, where: bool = False) -> dict:
    """Every layout in turn on this rank (a fresh DistTrainer each)."""
    out = {}
    for layout in layouts:
        overrides, name, precision = LAYOUTS[layout]
        out[layout] = train(f"{output_dir}/{layout}", name, precision, where=where, **overrides)
    return out


def references(output_dir: str, layouts: list[str]) -> dict[tuple[str, str], dict]:
    """(model, precision) -> the one-process run, for every model the layouts use, in fp32 and in their
    precisions."""
    wanted = {(LAYOUTS[x][1], p) for x in layouts for p in ("fp32", LAYOUTS[x][2])}
    return {(name, p): train(f"{output_dir}/one_{name}_{p}", name, p) for name, p in sorted(wanted)}


def errors(run: dict, fp32: dict) -> tuple[float, float]:
    """(largest loss difference over the steps, largest difference of what training changed in a parameter) of
    ``run`` against ``fp32``. The change, not the parameter: a model loaded in bf16 starts from rounded weights, a
    difference that is the load's, not the layout's (and for fp32-master runs the two are the same)."""
    import math

    loss = max(abs(a - b) for a, b in zip(run["losses"], fp32["losses"], strict=True))
    if set(run["params"]) != set(fp32["params"]):
        raise ValueError(f"parameter names differ: {sorted(set(run['params']) ^ set(fp32['params']))}")
    param = max(((run["params"][k] - run["initial"][k]) - (v - fp32["initial"][k])).abs().max().item()
                for k, v in fp32["params"].items())
    return loss, param if not math.isnan(param) else math.inf

EXCHANGES: dict[str, dict[str, tuple[str, ...]]] = {
    "ddp": {"all_reduce": ("reduction",)},
    "ddp_pure": {"all_reduce": ("reduction",)},
    "fsdp2": {"all_gather": ("gathered",), "reduce_scatter": ("reduction",)},
    "fsdp2_pure": {"all_gather": ("gathered",), "reduce_scatter": ("reduction",)},
    # forward: the row-parallel outputs (a matmul's); backward: the gradients of the column-parallel inputs (the
    # normed residual); the logits gathered for the loss
    "tp": {"all_reduce": ("matmuls", "residual"), "all_gather": ("matmuls",)},
    "tp_sp": {"all_gather": ("matmuls", "residual"), "reduce_scatter": ("matmuls", "residual"),
              "all_reduce": ("residual",)},
    "pp": {"send": ("residual",), "recv": ("residual",)},
    "cp": {"all_to_all": ("matmuls",), "all_reduce": ("reduction",)},  # q, k, v and the output; one grad bucket
    "ep_fsdp2": {"all_gather": ("gathered",), "reduce_scatter": ("reduction",), "all_to_all": ("residual",)},
    "zero2": {"all_gather": ("gathered",), "all_reduce": ("reduction",)},  # gloo: the reduce-scatter as all-reduce
    "zero3": {"all_gather": ("gathered",), "reduce_scatter": ("reduction",)},
}
"""layout -> collective kind -> the tensor classes (``hf_dist.precision.TensorDtypes`` fields) its data calls
(1 KiB and up, floating point) carry"""


def forecast(layout: str, run: dict):
    """``(preset, TensorDtypes)`` the planner forecasts for this run's resolved layout."""
    from hf_dist.precision import precision_that_runs, tensor_dtypes

    preset = precision_that_runs(run["layout"], LAYOUTS[layout][2])
    return preset, tensor_dtypes(run["layout"], preset)


def dtype_mismatches(layout: str, run: dict) -> list[str]:
    """Where the measured step's dtypes differ from the forecast (empty: every tensor class is what it says)."""
    from hf_dist.metrics.ledger_minimum import measured_rows

    _, want = forecast(layout, run)
    led = run["ledger"]
    seen = {"parameters": led["param_dtypes"], "gradients": led["grad_dtypes"],
            "optimizer_states": led["optimizer_dtypes"], "matmuls": {}}
    if run["layout"].is_deepspeed:  # its gradients live in the engine's buckets (``p.grad`` is None): the
        del seen["gradients"]       # reduction's dtype below is theirs
    for phase in ("forward", "backward"):
        seen["matmuls"] = {**seen["matmuls"], **led["matmul_dtypes"].get(phase, {})}
    out = [f"{name}: {sorted(got)} != {getattr(want, name)}" for name, got in seen.items()
           if set(got) != {getattr(want, name)}]
    if led["loss_dtype"] != "float32":  # transformers' loss upcasts the logits; accelerate casts outputs to fp32
        out.append(f"loss: {led['loss_dtype']} != float32")
    kinds = EXCHANGES[layout]
    data = [r for r in measured_rows([led]) if not r.small and r.dtype in ("float32", "bfloat16")]
    for row in data:
        allowed = {getattr(want, c) for c in kinds.get(row.kind, ())}
        if row.dtype not in allowed:
            out.append(f"{row.kind} {row.dtype} x{row.count:g} on {row.group}: expected {sorted(allowed)} "
                       f"({', '.join(kinds.get(row.kind, ('not expected',)))})")
    missing = set(kinds) - {r.kind for r in data}
    out += [f"{kind}: expected, not measured" for kind in sorted(missing)]
    return out

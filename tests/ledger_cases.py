"""Layouts whose step ledger ``bench/ledger.py`` prints and ``tests/test_ledger.py`` pins (importable by spawned ranks).

``ranks(rank, world, layouts, output_dir)`` trains each layout with a fresh ``DistTrainer`` on 2 gloo ranks for
``STEPS`` optimizer steps and measures the last (``hf_dist.metrics.ledger.attach_ledger``: steady state, after
DDP's bucket rebuild and the optimizer's first step). Models: a tiny Llama (hidden 64, 2 layers, vocab 256, fp32)
and, for EP, a tiny Qwen3-MoE (hidden 32, 2 layers, 4 experts, top-3, vocab 256); micro-batch 2 x 32 tokens per
rank; PP runs 2 micro-batches (1F1B).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from trainer_harness import SEQ as SEQ_LEN  # tokens per row

REPO = Path(__file__).resolve().parents[1]

STEPS = 3
LAYOUTS: dict[str, dict] = {
    "ddp": {},
    "fsdp2": {"fsdp2": True},
    "tp": {"tp_size": 2},
    "tp_sp": {"tp_size": 2, "tp_sequence_parallel": True},
    "pp": {"pp_size": 2, "pp_microbatches": 2},
    "ep_fsdp2": {"ep_size": 2, "fsdp2": True},
    "cp": {"cp_size": 2},
    "zero3": {},
}
"""layout -> DistTrainingArguments overrides (2 ranks); ZeRO-3 comes from the launch environment (``LAUNCH_ENV``)"""
LAUNCH_ENV: dict[str, dict[str, str]] = {
    "zero3": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no",
              "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero3.json", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"},
}
"""layout -> what ``accelerate launch --config_file accelerate_configs/<layout>.yaml`` puts in each rank's
environment (set for that layout's run only; the config path is relative to the repository)"""

def _model(layout: str):
    from trainer_harness import VOCAB, as_loaded

    from hf_dist.models import build_tiny_model

    if layout == "ep_fsdp2":
        from ep_cases import moe_config

        config = moe_config("qwen3_moe")
        config.vocab_size = VOCAB
        return as_loaded(build_tiny_model(config))
    return as_loaded(build_tiny_model(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2))


def _shape(model, args, dims, flops_per_token: float) -> tuple[object, float]:
    """The ``StepShape`` of this run and the minimum FLOPs of its global batch (``model`` not yet laid out)."""
    from trainer_harness import SEQ

    from hf_dist.metrics.ledger_minimum import StepShape

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    def size(p) -> int:  # a ZeRO-3 model is built partitioned (``zero.Init``): ds_numel is the whole
        return (getattr(p, "ds_numel", None) or p.numel()) * p.element_size()

    experts = sum(size(p) for n, p in model.named_parameters() if ".experts." in n)
    micro = args.pp_microbatches if dims.pp_enabled else args.gradient_accumulation_steps
    shape = StepShape(layers=c.num_hidden_layers, hidden=c.hidden_size, q_dim=c.num_attention_heads * head_dim,
                      kv_dim=c.num_key_value_heads * head_dim,
                      units=c.num_hidden_layers + (1 if c.tie_word_embeddings else 3),  # + root, untied embedding and head
                      param_bytes=sum(size(p) for p in model.parameters()),
                      expert_param_bytes=experts, tokens_per_micro=args.per_device_train_batch_size * SEQ,
                      micro_batches=micro, top_k=getattr(c, "num_experts_per_tok", 0),
                      sp_partial_bytes=sum(size(p) for n, p in model.named_parameters() if n.endswith("norm.weight"))
                      if args.tp_sequence_parallel else 0)
    return shape, flops_per_token * args.per_device_train_batch_size * micro * dims.dp * SEQ


@contextlib.contextmanager
def _launch_env(layout: str):
    env = {k: str(REPO / v) if k.endswith("_FILE") else v for k, v in LAUNCH_ENV.get(layout, {}).items()}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run(layout: str, output_dir: str, where: bool) -> dict:
    with _launch_env(layout):
        return _train(layout, output_dir, where)


def _train(layout: str, output_dir: str, where: bool) -> dict:
    from trainer_harness import SEQ, token_dataset

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.metrics.ledger import attach_ledger
    from hf_dist.planner.flops import module_flop_counts

    args = DistTrainingArguments(
        output_dir=f"{output_dir}/{layout}", max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=100, save_strategy="no", report_to=[], seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0, **LAYOUTS[layout])
    model = _model(layout)
    plain = _model(layout)  # the trainer lays ``model`` out in place
    flops_per_token = module_flop_counts(plain).per_token(SEQ)[1]
    trainer = DistTrainer(model=model, args=args, train_dataset=token_dataset())
    shape, flops = _shape(plain, trainer.args, trainer.dims, flops_per_token)
    callback = attach_ledger(trainer, STEPS, where=where)
    trainer.train()
    return {"ledger": callback.ledger.plain(), "shape": shape, "min_flops": flops,
            "dp": trainer.dims.dp, "cp": trainer.dims.cp}


def ranks(rank: int, world_size: int, layouts: list[str], output_dir: str, where: bool = False) -> dict:
    """Every layout in turn on this rank (a fresh DistTrainer each); layout -> its ledger and shape."""
    return {layout: _run(layout, output_dir, where) for layout in layouts}

"""May TRL's DPO or GRPO trainer run this layout? One pure answer for the trainers and the planner.

``dpo_layout_refusal`` / ``grpo_layout_refusal`` say why ``DistDPOTrainer`` / ``DistGRPOTrainer`` do not run a
``hf_dist.strategy.Layout`` (with the config's options, ``args``; None: TRL's defaults), or None: the layouts their
parity tests prove (DDP and FSDP2 FULL_SHARD / SHARD_GRAD_OP; TP, and for DPO CP and PP (TRL's default loss), with
every rank in one group; for GRPO EP over all the data-parallel ranks; full fine-tune and LoRA). The trainers call them
before any process group (``hf_dist.trainer.trl_layout.check_trl_layout``), ``hf-dist plan --trainer`` before
proposing a layout (``trainer_layout_refusal``). Pure: no torch, no TRL import.

Not here: the trainers (``hf_dist.trainer.dpo``, ``hf_dist.trainer.grpo``).
"""

from __future__ import annotations

from collections.abc import Mapping

from hf_dist.strategy import Layout

MODEL_PARALLEL_SIZES = ("tp_size", "pp_size", "cp_size", "ep_size")
_FIX = "drop it and shard with FSDP2 instead (--fsdp2, or accelerate_configs/fsdp.yaml), or run DDP"
TRL_TRAINERS = ("dpo", "grpo")
"""The TRL trainers with a frozen reference that hf_dist runs."""


def trl_layout_refusal(layout: Layout, args, *, config: str, model_parallel: Mapping[str, str],
                       fsdp2_options: Mapping[str, str]) -> str | None:
    """Why a TRL trainer does not run on ``layout`` with ``args`` (pure), or None.

    ``config`` names the config class in the message; ``model_parallel`` maps each of ``MODEL_PARALLEL_SIZES`` to why
    that axis does not run; ``fsdp2_options`` maps a boolean option to why hf_dist's FSDP2 does not take it."""
    sizes = {"tp_size": layout.tp, "pp_size": layout.pp, "cp_size": layout.cp, "ep_size": layout.ep}
    trainer = config.replace("Config", "Trainer")
    for name in MODEL_PARALLEL_SIZES:
        if sizes[name] > 1 and name in model_parallel:
            return (f"{name}={sizes[name]} in {config}: {model_parallel[name]}, and {trainer} has no parity test for "
                    f"it yet; {_FIX}")
    if layout.ep > 1 and layout.tp > 1:
        return (f"ep_size={layout.ep} with tp_size={layout.tp} in {config}: {trainer} has no parity test for EP x TP "
                f"yet (DistTrainer has: tests/test_ep_tp.py); use ep_size or tp_size alone")
    if layout.ep > 1 and layout.ep != layout.dp:
        return (f"ep_size={layout.ep} over {layout.dp} data-parallel ranks in {config}: {trainer} runs experts spread "
                f"over every data-parallel rank (ep_size = dp) and has no parity test for ranks that hold the same "
                f"experts yet; use ep_size={layout.dp}, or drop ep_size")
    if layout.ep > 1 and layout.strategy not in ("ddp", "fsdp_full_shard"):
        return (f"ep_size={layout.ep} with {layout.strategy} in {config}: {trainer} has a parity test for EP with DDP "
                f"or FSDP2 FULL_SHARD only; use one of them (fsdp2_reshard_after_forward=True), or drop ep_size")
    if (layout.tp > 1 or layout.cp > 1) and (why := _model_parallel_refusal(layout, config, trainer)) is not None:
        return why
    if layout.is_deepspeed:
        return (f"DeepSpeed {layout.strategy} with {config}: the reference would be prepared by TRL's DeepSpeed path, "
                f"which no {trainer} parity test covers yet; {_FIX}")
    if layout.strategy == "fsdp_hybrid_shard":
        return (f"fsdp2_dp_replicate={layout.dp_replicate} (HYBRID_SHARD) with {config}: no {trainer} parity test "
                f"covers the reference model under HSDP yet; drop fsdp2_dp_replicate (FULL_SHARD)")
    if layout.offload != "none":
        return (f"fsdp2_cpu_offload=True with {config}: no {trainer} parity test covers an offloaded reference model "
                f"yet; drop --fsdp2_cpu_offload")
    if layout.is_fsdp:
        for name, why in fsdp2_options.items():
            if getattr(args, name, False):
                return f"{name}=True with FSDP2 in {config}: {why}; drop --{name}, or run it under DDP"
    return None


def fused_lm_head_refusal(*, tp: int, sequence_parallel: bool, vocab_parallel: bool, config: str) -> str | None:
    """Why TRL's fused LM head does not run with these TP options (pure), or None. It multiplies plain hidden states
    by the whole ``lm_head`` weight; hf_dist's default TP plan keeps both whole (replicated on every TP rank), and
    these two options shard them."""
    for name, value in (("tp_vocab_parallel", vocab_parallel), ("tp_sequence_parallel", sequence_parallel)):
        if value and tp > 1:
            return (f"{name}=True with tp_size={tp} in {config}: TRL's fused LM head needs the whole lm_head weight "
                    f"and hidden states, which {name.removeprefix('tp_')} parallelism shards; drop --{name} (the "
                    f"decoder blocks stay tensor-parallel)")
    return None


def _model_parallel_refusal(layout: Layout, config: str, trainer: str) -> str | None:
    """Why a TRL trainer with a frozen reference does not run this TP or CP layout, or None. What runs is what
    ``tests/test_trl_model_parallel.py`` proves: every rank in one TP group, or one CP group (DPO), with no data
    parallelism beside it; under TP the default plan (whole lm_head); full fine-tune and LoRA."""
    if (why := fused_lm_head_refusal(tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                     vocab_parallel=layout.vocab_parallel, config=config)) is not None:
        return why
    if layout.tp > 1 and layout.cp > 1:
        return (f"tp_size={layout.tp} with cp_size={layout.cp} in {config}: {trainer} has no parity test for the two "
                f"together yet; use one of them")
    name, size = ("tp_size", layout.tp) if layout.tp > 1 else ("cp_size", layout.cp)
    if layout.is_fsdp or layout.is_deepspeed or layout.dp > 1:
        engine = f"{layout.strategy} over {layout.dp} data-parallel rank(s)"
        return (f"{name}={size} with {engine} in {config}: {trainer} runs {name.removesuffix('_size')} with every rank "
                f"in one group (world size {layout.world_size} = {name} x 1) and has no parity test beside data "
                f"parallelism or a sharded engine yet; launch {name} processes without FSDP2/DeepSpeed, or drop "
                f"{name} and shard with FSDP2")
    return None


_DPO_MODEL_PARALLEL = {
    "ep_size": "experts are exchanged all-to-all in the policy and would have to be in the frozen reference as well",
}
_REFERENCE_UNDER_FSDP = ("TRL handles the reference under its own FSDP only (hf_dist's fully_shard is not "
                         "accelerate's FSDP), and no parity test covers it")
_DPO_FSDP2_OPTIONS = {"precompute_ref_log_probs": _REFERENCE_UNDER_FSDP, "sync_ref_model": _REFERENCE_UNDER_FSDP}


_DPO_PIPELINE_SCHEDULES = ("1f1b", "gpipe")
_DPO_PIPELINE_DEFAULTS = {  # option -> (what DistDPOTrainer's pipeline step computes, why another value is refused)
    "loss_type": (("sigmoid", ("sigmoid",)), "the last stage computes TRL's default sigmoid loss only"),
    "loss_weights": ((None, (1.0,)), "the last stage computes one unweighted loss"),
    "f_divergence_type": (("reverse_kl",), "the last stage scores log-ratios as TRL's default reverse KL"),
    "ld_alpha": ((None,), "the last stage sums every completion token (no LD-DPO length weighting)"),
    "use_weighting": ((False,), "the last stage applies no WPO weights"),
    "precompute_ref_log_probs": ((False,), "the reference runs through the pipeline in every step"),
    "sync_ref_model": ((False,), "the reference pipeline is never synced from the policy"),
}


def _dpo_pipeline_refusal(layout: Layout, args) -> str | None:
    """Why DPO does not run this PP layout or option (pure), or None. What runs is what
    ``tests/test_trl_model_parallel.py`` proves: every rank in one pipeline (no data, tensor, context or expert
    parallelism beside it), TRL's default sigmoid loss, full fine-tune and LoRA."""
    others = {"tp_size": layout.tp, "cp_size": layout.cp, "ep_size": layout.ep}
    for name, size in others.items():
        if size > 1:
            return (f"pp_size={layout.pp} with {name}={size} in DistDPOConfig: DistDPOTrainer has no parity test for "
                    f"the two together yet; use one of them")
    if layout.is_deepspeed or layout.dp > 1:  # FSDP2 over one dp rank shards nothing: the stages run as without it
        return (f"pp_size={layout.pp} with {layout.strategy} over {layout.dp} data-parallel rank(s) in DistDPOConfig: "
                f"DistDPOTrainer runs pp with every rank in one pipeline (world size {layout.world_size} = pp_size x "
                f"1) and has no parity test beside data parallelism or DeepSpeed yet; launch pp_size processes, or "
                f"drop pp_size and shard with FSDP2")
    schedule = getattr(args, "pp_schedule", "1f1b") if args is not None else "1f1b"
    if schedule not in _DPO_PIPELINE_SCHEDULES:
        return (f"pp_schedule={schedule!r} with DistDPOConfig: DistDPOTrainer has a parity test for one stage per "
                f"rank ({', '.join(_DPO_PIPELINE_SCHEDULES)}) only; use pp_schedule='1f1b', or drop pp_size")
    for name, (allowed, why) in _DPO_PIPELINE_DEFAULTS.items():
        value = getattr(args, name, allowed[0]) if args is not None else allowed[0]
        if (tuple(value) if isinstance(value, list) else value) not in allowed:
            return (f"{name}={value!r} with pp_size={layout.pp} in DistDPOConfig: {why}, and no parity test covers "
                    f"another value; use {name}={allowed[0]!r} (TRL's default), or drop pp_size")
    return None


def dpo_layout_refusal(layout: Layout, args=None) -> str | None:
    """Why DPO does not run on ``layout`` with ``args`` (pure), or None. The layouts it runs are the ones
    ``tests/test_dpo.py`` and ``tests/test_trl_model_parallel.py`` prove against one
    process: DDP, FSDP2 FULL_SHARD / SHARD_GRAD_OP, TP, CP or PP as one group (PP with TRL's default sigmoid loss),
    full and LoRA."""
    if layout.pp > 1 and (why := _dpo_pipeline_refusal(layout, args)) is not None:
        return why
    return trl_layout_refusal(layout, args, config="DistDPOConfig", model_parallel=_DPO_MODEL_PARALLEL,
                              fsdp2_options=_DPO_FSDP2_OPTIONS)


_GRPO_MODEL_PARALLEL = {
    "pp_size": "generation runs the whole model's forward once per new token on every rank, and a pipeline splits "
               "the model over stages (there is no pipelined generate)",
    "cp_size": "generation grows each sequence one token at a time on one rank, which context parallelism splits "
               "over the cp ranks (TRL's GRPOTrainer refuses it too)",
}
_GRPO_FSDP2_OPTIONS = {
    "use_vllm": "TRL's vLLM weight sync gathers the policy through accelerate's FSDP, which hf_dist's fully_shard "
                "is not, and no parity test covers it",
    "use_transformers_continuous_batching": "generate_batch bypasses the FSDP root's gathered generate, and no "
                                            "parity test covers it",
    "sync_ref_model": "TRL syncs the reference under its own FSDP only (hf_dist's fully_shard is not accelerate's "
                      "FSDP), and no parity test covers it",
}


def grpo_layout_refusal(layout: Layout, args=None) -> str | None:
    """Why GRPO does not run on ``layout`` with ``args`` (pure), or None. The layouts it runs are the ones
    ``tests/test_grpo.py``, ``tests/test_trl_model_parallel.py`` and ``tests/test_grpo_moe.py`` prove against one
    process: DDP, FSDP2 FULL_SHARD / SHARD_GRAD_OP, TP as one group, and EP over all the data-parallel ranks (DDP or
    FSDP2) of a mixture-of-experts policy, full and LoRA."""
    return trl_layout_refusal(layout, args, config="DistGRPOConfig", model_parallel=_GRPO_MODEL_PARALLEL,
                              fsdp2_options=_GRPO_FSDP2_OPTIONS)


def trainer_layout_refusal(trainer: str, layout: Layout, args=None) -> str | None:
    """Why ``trainer`` (``dpo`` or ``grpo``) does not run ``layout``, or None."""
    if trainer not in TRL_TRAINERS:
        raise ValueError(f"trainer={trainer!r} has no TRL layout rule; use one of {', '.join(TRL_TRAINERS)}")
    return (dpo_layout_refusal if trainer == "dpo" else grpo_layout_refusal)(layout, args)

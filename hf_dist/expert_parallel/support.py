"""Which models run expert-parallel in hf_dist, and why the others are refused (pure: configs in, reasons out).

A model runs EP when its config ships transformers' ``base_model_ep_plan`` in the form every supported MoE type
uses: the experts module (``ep_dispatch_experts``, tokens dispatched to it) holding 3-D expert weights
``gate_up_proj [E, 2I, H]`` (non-gated experts: ``up_proj [E, I, H]``, nemotron_h) / ``down_proj [E, H, I]`` (and
their biases, gpt-oss) split on the expert dimension (``grouped_gemm``), with ``E`` divisible by ``ep``. Dense models and MoE types whose experts are a list of
per-expert modules or another layout are refused by name.
"""

from __future__ import annotations

from hf_dist.families import EXPERT_COUNT_FIELDS, family, num_experts, proven_types, text_config

_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def ep_plan(config) -> dict[str, str]:
    """The model's own expert-parallel plan (``base_model_ep_plan``: module/parameter pattern -> style)."""
    return dict(getattr(text_config(config), "base_model_ep_plan", None) or {})


EP_PARITY_TESTED = tuple(sorted(proven_types("ep")))
"""Model types whose registry records prove EP (``tests/ep_cases.py`` ``CASES`` and ``SWEEP_CASES``; a test keeps
the two the same)."""


def ep_refusal(config, ep: int, pp: int = 1, cp: int = 1, tp: int = 1) -> str | None:
    """Why ``config``'s model cannot run with ``ep_size=ep`` (inside ``pp`` pipeline stages, with ``cp``
    context-parallel ranks, or beside ``tp`` tensor-parallel ranks) in hf_dist, or None when it can. EP x PP, EP x CP
    and EP x TP need their own records (``ep_pp``, ``ep_cp``, ``ep_tp``): the factors' proofs do not make their
    product's."""
    model_type = getattr(config, "model_type", None)
    config = text_config(config)
    experts = num_experts(config)
    plan = ep_plan(config)
    if experts is None and not plan:
        return f"model_type={model_type!r} is not a mixture-of-experts model (no routed experts, no base_model_ep_plan)"
    if not plan:
        return (f"model_type={model_type!r} has {experts} experts but ships no base_model_ep_plan (its experts are "
                f"not in transformers' expert-parallel form)")
    dispatch = [k for k, style in plan.items() if style == "ep_dispatch_experts"]
    weights = {k: style for k, style in plan.items() if style != "ep_dispatch_experts"}
    odd = sorted(f"{k}: {s}" for k, s in weights.items()
                 if s != "grouped_gemm" or k.rsplit(".", 1)[-1] not in _EXPERT_WEIGHTS)
    if len(dispatch) != 1 or odd or not weights:
        return (f"model_type={model_type!r}'s experts are not the 3-D gate_up_proj/down_proj form with token dispatch "
                f"that hf_dist's EP runs (plan: {plan})")
    if experts is None:
        return f"model_type={model_type!r}: its config names no routed-expert count ({', '.join(EXPERT_COUNT_FIELDS)})"
    if experts % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        return f"ep_size={ep} does not divide the {experts} experts of each layer; use ep_size in {valid}"
    if not family(model_type).proves("ep"):
        return (f"model_type={model_type!r} has experts in the form EP runs, but no EP parity case in hf_dist yet "
                f"(docs/coverage.md lists the proven types)")
    if pp > 1 and not family(model_type).proves("ep_pp"):
        proven = ", ".join(sorted(proven_types("ep_pp")))
        return (f"model_type={model_type!r} has no EP x PP parity case in hf_dist (experts sharded inside pipeline "
                f"stages are proven for {proven}); use pp_size=1 with ep_size, or ep_size=1 with pp_size")
    if cp > 1 and not family(model_type).proves("ep_cp"):
        proven = ", ".join(sorted(proven_types("ep_cp")))
        return (f"model_type={model_type!r} has no EP x CP parity case in hf_dist (experts over the data-parallel ranks "
                f"while each sequence is split are proven for {proven}); use cp_size=1 with ep_size, or ep_size=1 "
                f"with cp_size")
    if tp > 1 and not family(model_type).proves("ep_tp"):
        proven = ", ".join(sorted(proven_types("ep_tp")))
        return (f"model_type={model_type!r} has no EP x TP parity case in hf_dist (attention split by TP, whole "
                f"experts split by EP, are proven for {proven}); use tp_size=1 with ep_size, or ep_size=1 with tp_size")
    return None


def check_ep_support(config, ep: int, pp: int = 1, cp: int = 1, tp: int = 1) -> None:
    """Raise ``ValueError`` naming the model, the rule and the fix when ``ep_size=ep`` (with ``pp_size=pp``,
    ``cp_size=cp``, ``tp_size=tp``) cannot run on it."""
    if ep == 1:
        return
    if why := ep_refusal(config, ep, pp, cp, tp):
        with_pp = "".join(f" with {name}_size={size}" for name, size in (("pp", pp), ("cp", cp), ("tp", tp))
                          if size > 1)
        raise ValueError(f"ep_size={ep}{with_pp} is refused: {why}; set ep_size=1 (FSDP2 or DDP alone train it)")




def ep_coverage() -> dict[str, str]:
    """EP decision per causal-LM model type of the installed transformers: ``"yes"`` (its record proves EP: parity
    tested on a tiny config of the type), ``"dense"`` (its default config is not a MoE model), or the reason its default
    config does not run (refused, or supported but untested). A proven type whose default config's numbers are refused
    (an expert count EP=2 does not divide, or none) is ``"yes"``; ``bench/coverage.py`` notes the default's refusal."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    table = {}
    for name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(name)
        except Exception as error:  # noqa: BLE001 - a config that cannot be built is the note
            table[name] = f"its default config cannot be built ({type(error).__name__})"
            continue
        text = text_config(config)
        if family(name).proves("ep"):
            table[name] = "yes"
        elif num_experts(text) is None and not ep_plan(text):
            table[name] = "dense"
        else:
            table[name] = ep_refusal(config, 2) or "yes"
    return table

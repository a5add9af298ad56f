"""The parity harness: what "a layout equals one process" means in every parity test, in one place.

- ``tiny_config(case)``: the one tiny-config builder. A case is a model type (or ``type:variant``) and the
  parallelism it is built for; the registry's record (``hf_dist.families``) decides which case table the values come
  from (``ep_cases`` for routed-expert models, ``pp_sweep_cases`` / ``tp_sweep_cases`` otherwise), and
  ``default_fields`` lists the fields the registry says matter (``Family.parity_fields``) that a case left at
  their default: ``tests/test_families.py`` holds every case to none.
- ``tiny_model(config)``: the model built from its config with a fixed seed, optionally saved and loaded back as users
  load theirs (``trainer_harness.as_loaded``).
- ``reference_run(model, steps)``: the one-process reference trainer. Each step is a list of micro-batches run by
  ``hf_dist.models.reference.reference_step``, the reference the before-launch layout canary uses, so the tests
  and the canary define "one process" (the MoE router aux loss per micro-batch included) the same way.
- ``layout_run(model, steps)``: its counterpart on the ranks of a model a layout parallelised outside a Trainer
  (each step one global batch, sliced by data-parallel rank, the loss over the whole batch's tokens, a MoE's router
  aux per dp rank's micro-batch; under context parallelism ``token_weighted_loss`` inside the cp split); returns
  what ``reference_run`` returns, gathered whole (``full_grads``, ``full_state_dict``).
- ``pipelined_run(pipe, steps, recipe)``: the same training with a ``PipelinedCausalLM`` (the PP layout side, in the
  shape ``assert_parity`` reads).
- ``assert_parity(run, ref)``: the one comparison: losses, then every parameter (or the first step's gradients) with
  the same keys on both sides, router and expert weights named so a comparison that skipped them fails.
- ``matrix()``: the (model type, parallelism) cells the harness has cases for, generated from the case lists
  below; every cell the registry calls proven must be one of them.

Importable by spawned ranks (module level only). The Trainer-level runs are ``trainer_harness``'s (``train_tiny``;
``trainer_run``: a ``DistTrainer`` run with the first optimizer step's gradients of a ``train()`` call or of a resumed
run), compared with one process through ``assert_parity`` too; ``test_parity_harness`` ties its one-process run to
``reference_run``. The TRL trainers' runs are compared through ``trl_parity.assert_trl_parity`` (their logs and
weights in ``assert_parity``'s shape).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.testing import assert_close

from hf_dist.families import family, num_experts, text_config
from hf_dist.models.reference import IGNORE_INDEX, reference_step, split_rows

__all__ = [
    "CP_CASES", "EP_PP_CASES", "EP_TP_AUX", "EP_TP_CASES", "LEFT_AT_DEFAULT", "MOE_ADAMW", "MOE_CP_CASES",
    "MOE_GLOBAL_BATCH", "MOE_STEPS", "PP_SGD", "Recipe", "TP_MOE_CASES", "TP_SGD", "assert_parity",
    "case_type", "cases", "default_fields", "full_grads", "layout_run", "masked_batches",
    "matrix", "pipelined_run", "reference_run", "slice_rows", "split_rows", "tiny_config", "tiny_model",
]

# -- the case lists (each parity test runs its list; ``matrix`` reads them all) ---------------------------------

TP_MOE_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""TP=2 on MoE types (``tests/test_moe_tp.py``; configs ``ep_cases``)."""
CP_CASES = ("llama", "mistral", "gemma2", "qwen3")
"""Context parallelism (``tests/test_context_parallel.py``; its own long-sequence configs)."""
EP_PP_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""EP x PP through the DistTrainer (``tests/test_ep_pp.py``; configs ``ep_cases``)."""
MOE_CP_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""MoE under CP and EP x CP, at 2,048 tokens (``tests/test_moe_cp.py``; its own long-sequence configs)."""
EP_TP_CASES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
"""EP x TP through the DistTrainer (``tests/test_ep_tp.py``; configs ``ep_cases`` with a sliding window, aux
coefficient ``EP_TP_AUX``)."""
EP_TP_AUX = 0.1


LEFT_AT_DEFAULT: dict[tuple[str, str], tuple[str, ...]] = {}
"""(case, parallelism) -> the registry's field groups (``Family.parity_fields``) its config leaves at the default: known
gaps, each to be closed by a case value (and its test run), never added to. ``tests/test_families.py`` fails when a
case leaves another group at its default, and when a gap listed here is closed (remove its row)."""


def cases(parallelism: str) -> dict[str, tuple[str, ...]]:
    """``{test file: case names}`` of the parity tests of ``parallelism`` (the files the registry's records name)."""
    from ep_cases import CASES, SWEEP_CASES
    from pp_sweep_cases import HYBRID, MOE, NAMED
    from tp_sweep_cases import TP_VARIANTS

    from hf_dist.families import proven_types

    dense = ("dense", "classic", "hybrid")
    if parallelism == "tp":
        return {"tests/test_tp_sweep.py": tuple(sorted(proven_types("tp", kinds=dense))) + TP_VARIANTS,
                "tests/test_moe_tp.py": TP_MOE_CASES}
    if parallelism == "pp":
        hybrid = proven_types("pp", kinds=("hybrid",))
        return {"tests/test_pp_sweep.py": tuple(sorted(proven_types("pp", kinds=dense) - hybrid))
                + tuple(sorted(NAMED)) + tuple(sorted(HYBRID)),
                "tests/test_pp_moe.py": tuple(sorted(MOE))}
    if parallelism == "ep":
        return {"tests/test_expert_parallel.py": CASES + SWEEP_CASES}
    if parallelism == "cp":
        return {"tests/test_context_parallel.py": CP_CASES, "tests/test_moe_cp.py": MOE_CP_CASES}
    if parallelism == "ep_pp":
        return {"tests/test_ep_pp.py": EP_PP_CASES}
    if parallelism == "ep_cp":
        return {"tests/test_moe_cp.py": MOE_CP_CASES}
    if parallelism == "ep_tp":
        return {"tests/test_ep_tp.py": EP_TP_CASES}
    raise ValueError(f"no parity cases for parallelism {parallelism!r}")


def case_type(case: str) -> str:
    """The model type a case runs (``"falcon:mha"`` -> ``"falcon"``; a wrapper's case its own type)."""
    return case.split(":")[0]


def matrix() -> dict[tuple[str, str], str]:
    """``{(model type, parallelism): test file}`` for every cell some parity test has a case for."""
    from hf_dist.families import PARALLELISMS

    return {(case_type(case), parallelism): test
            for parallelism in PARALLELISMS for test, names in cases(parallelism).items() for case in names}


# -- the one tiny-config builder ----------------------------------------------------------------------------

def tiny_config(case: str, parallelism: str | None = None):
    """The tiny config of ``case`` with non-default values (a model type, or a ``type:variant`` of a case table).

    Routed-expert types (the registry's ``moe`` kind, and hybrids proven for EP) take ``ep_cases``' router values
    (aux loss on, non-default top-k) for EP and TP (for EP x TP with coefficient ``EP_TP_AUX`` and a sliding window
    where the case table leaves it at the default), ``pp_sweep_cases.MOE`` (4 layers, 2 per stage) for PP; other
    types the PP sweep's values for PP and the TP sweep's otherwise (CP's long-sequence configs are
    ``test_context_parallel``'s own); ``type:variant`` cases come from the table that names them. A MoE type with no
    row in its table raises (``KeyError``): a claimed cell without a case fails ``tests/test_families.py``.
    """
    import pp_sweep_cases as pp
    import tp_sweep_cases as tp
    from ep_cases import moe_config

    record = family(case_type(case))
    if parallelism == "pp":
        if case in pp.HYBRID:
            return pp.hybrid_config(case)
        if case in pp.NAMED:
            return pp.named_config(case)
        if case in pp.LAYOUTS:
            return pp.layout_config(case)
        return pp.moe_config(case) if record.kind == "moe" else pp.non_default_config(case)
    if parallelism == "ep_tp":
        return moe_config(case, aux=EP_TP_AUX)
    if record.kind == "moe" or (parallelism in ("ep", "ep_pp") and record.proves("ep")):
        return moe_config(case)
    return tp.sweep_config(case)


def default_fields(config) -> list[str]:
    """The fields the registry says matter for ``config``'s type (``Family.parity_fields``) that ``config`` leaves at
    its config class's default: empty for a case that tests what it claims. Router fields count only where the config
    has routed experts; a field the config class does not have is not asked for."""
    text = text_config(config)
    defaults = type(text)()
    experts = num_experts(text) is not None
    missing = []
    for group, alternatives in family(getattr(config, "model_type", None)).parity_fields.items():
        if group in ("router", "aux loss") and not experts:
            continue
        applies = [a for a in ((x,) if isinstance(x, str) else x for x in alternatives) if hasattr(defaults, a[0])]
        settable = [a for a in applies if not any(isinstance(getattr(type(text), n, None), property) for n in a)]
        if settable and not any(all(getattr(text, n) != getattr(defaults, n) for n in a) for a in settable):
            missing.append(group)
    return missing


def tiny_model(config, *, seed: int = 0, loaded: bool = False, **load_kwargs):
    """``config``'s causal LM, fp32, seeded (the same weights in every process); ``loaded``: written to disk and
    read back with ``from_pretrained`` as users load theirs (eval mode)."""
    from hf_dist.models.tiny import build_tiny_model

    model = build_tiny_model(config, seed=seed)
    if not loaded:
        return model
    from trainer_harness import as_loaded

    return as_loaded(model, **load_kwargs)


# -- the one reference --------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The optimizer steps a parity test runs on both sides."""

    lr: float
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """``adamw`` or ``sgd`` (plain SGD: parameters after it compare gradients; AdamW amplifies rounding noise)."""
    weight_decay: float | None = None
    """None: the optimizer's own default (AdamW 0.01, SGD 0)."""
    max_norm: float | None = None
    """Clip the gradient norm to this (the norm is recorded per step); None: no clipping."""

    def optimizer_for(self, params):
        decay = {} if self.weight_decay is None else {"weight_decay": self.weight_decay}
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, **decay)
        return torch.optim.AdamW(params, lr=self.lr, **decay)


MOE_ADAMW = Recipe(lr=1e-3, weight_decay=0.1, max_norm=0.05)
"""The EP / MoE-TP tests: 3 AdamW steps, clipping active (``max_norm`` below every step's norm)."""
MOE_STEPS, MOE_GLOBAL_BATCH = 3, 8
TP_SGD = Recipe(lr=0.5, optimizer="sgd", max_norm=0.1)
"""The dense TP tests and the ``parallelize``-level CP tests: plain SGD (parameters after it compare gradients),
clipping active (every step's norm above ``max_norm``; the TP sweep's smallest, granite's and OPT's, are about 0.2,
the CP cases' about 0.13), so each update is ``lr x max_norm`` = 0.05 long."""
PP_SGD = Recipe(optimizer="sgd", lr=1.0, max_norm=0.05)
"""The PP coverage sweep, the PP MoE test and the PP layout tests (``pp_sweep_cases.LAYOUTS``): plain SGD, clipping
active on every step (every case's gradient norm stays above ``max_norm``), so the global norm across stages matters
and parameters compare gradients."""


def slice_rows(batch: Mapping[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Data-parallel rank ``rank``'s consecutive share of ``batch`` (the micro-batch it runs)."""
    return split_rows(batch, world)[rank]


def masked_batches(vocab: int, seq: int, steps: int, rows: int = 4) -> list[dict[str, torch.Tensor]]:
    """Fresh rows every step (seeded by the step): ``rows`` right-padded rows of lengths ``seq``, ``seq - 5``,
    ``seq // 2``, ``seq - 1``, then the same four 3 shorter for the next four rows and so on (at least 2), labels
    ``-100`` on the padding (the micro-batches and the data-parallel halves count different tokens)."""
    out = []
    base = torch.tensor([seq, seq - 5, seq // 2, seq - 1])
    lengths = (base.repeat((rows + 3) // 4)[:rows] - 3 * (torch.arange(rows) // 4)).clamp(min=2)
    for step in range(steps):
        ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(step))
        mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def reference_run(model, steps: Sequence[Sequence[Mapping[str, torch.Tensor]]], recipe: Recipe, *,
                  aux: bool = True, grads: bool = False) -> dict:
    """Train ``model`` in this process: each step runs its micro-batches through ``reference_step`` (loss summed
    over their label tokens over the step's, router aux loss per micro-batch), clips, and steps ``recipe``'s
    optimizer. Returns ``losses`` and ``norms`` per step (norms only with clipping), ``state`` (the state dict
    after the last step) and, with ``grads``, the first step's gradients by parameter name (a tied weight under each
    of its names, as the layout canary compares them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = recipe.optimizer_for(params)
    out: dict = {"losses": [], "norms": []}
    for index, micro_batches in enumerate(steps):
        out["losses"].append(reference_step(model, micro_batches, aux=aux))
        if grads and index == 0:
            out["grads"] = {n: p.grad.detach().clone()
                            for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
        if recipe.max_norm is not None:
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, recipe.max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient whole and in HF layout (fused parts de-interleaved), by name -- a tied weight under
    each of its names, as ``reference_run`` and the canary list it; a collective where gradients are DTensors, so
    every rank of the model's meshes calls it."""
    from hf_dist.state_dict import fused_keys, hf_layout

    fused = fused_keys(model)
    return {n: hf_layout(n, p.grad, fused).detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
            if p.grad is not None}


def layout_run(model, steps: Sequence[Mapping[str, torch.Tensor]], recipe: Recipe, *, dp_rank: int = 0, dp: int = 1,
               dp_group=None, grads: bool = False, optimizer=None) -> dict:
    """``reference_run`` on one rank of a model a layout parallelised (``hf_dist.parallelize``,
    ``apply_tensor_parallel``; every rank calls it). Each step is one global batch: this rank runs data-parallel rank
    ``dp_rank``'s consecutive rows (``slice_rows``), its loss summed over their label tokens over the whole batch's
    and scaled by ``dp`` (the layout averages gradients over the dp ranks), so the dp ranks' losses add up to the
    reference's and their gradient is its. Under context parallelism (``context_parallel_state(model)``) the cp ranks
    of a dp rank share its rows: the loss is ``token_weighted_loss`` inside ``split()`` (tokens counted over
    ``dp_group``, which is then the dp x cp ranks' group, ``dims.get_mesh("dp_cp")``; default the cp group, for
    ``dp=1``). The norm clipped is the HF Trainer's (``Trainer._mixed_mesh_grad_norm``: every mesh and plain tensor).
    A MoE's router aux counts once per dp rank (as ``token_weighted_loss`` weighs it; reference: ``split_rows(batch,
    dp)``). ``optimizer``: default ``recipe``'s. Returns ``reference_run``'s keys, whole (collectives); the losses
    summed over ``dp_group``."""
    import torch.distributed as dist
    from transformers import Trainer

    from hf_dist.context_parallel import context_parallel_state
    from hf_dist.state_dict import full_state_dict

    cp = context_parallel_state(model)
    if cp is not None and dp_group is None:
        if dp > 1:
            raise ValueError(f"layout_run under context parallelism with dp={dp}: pass dp_group, the dp x cp ranks' "
                             "group (dims.get_mesh('dp_cp').get_group())")
        dp_group = cp.group
    optimizer = optimizer or recipe.optimizer_for([p for p in model.parameters() if p.requires_grad])
    out: dict = {"losses": [], "norms": []}
    for index, batch in enumerate(steps):
        share = _layout_loss(model, batch, slice_rows(batch, dp_rank, dp), dp, dp_group, cp)
        if dp_group is not None:
            dist.all_reduce(share, group=dp_group)
        out["losses"].append(float(share))
        if grads and index == 0:
            out["grads"] = full_grads(model)
        if recipe.max_norm is not None:
            out["norms"].append(float(Trainer._mixed_mesh_grad_norm(None, model, recipe.max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    out["state"] = full_state_dict(model)
    return out


def _layout_loss(model, batch, rows, dp: int, group, cp) -> torch.Tensor:
    """``layout_run``'s forward and backward of this rank's ``rows`` of ``batch``; returns its share of the step's
    loss (the shares of the ``group`` ranks add up to the reference's loss)."""
    if cp is None:
        from hf_dist.trainer.router_loss import router_aux_parts

        tokens = max(int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()), 1)
        out = model(**rows, num_items_in_batch=tokens)
        coef, aux = router_aux_parts(model, out) or (0.0, torch.zeros(()))
        aux = coef * aux.to(out.loss.device)  # in ``out.loss`` once per dp rank: not scaled by dp (averaged)
        ((out.loss - aux) * dp + aux).backward()
        return (out.loss - aux + aux / dp).detach()
    from hf_dist.context_parallel import token_weighted_loss

    with cp.split():  # the share of the dp x cp token mean, scaled by dp x cp (the layout averages over them)
        scaled = token_weighted_loss(model, rows, cp, reduce_group=group, reduce_size=dp * cp.size)
        scaled.backward()
    return scaled.detach() / (dp * cp.size)


def pipelined_run(pipe, steps: Sequence[Mapping[str, torch.Tensor]], recipe: Recipe, *, dp_rank: int = 0,
                  dp: int = 1, grads: bool = False) -> dict:
    """``reference_run``'s training with a ``PipelinedCausalLM`` on every rank of its group: each step's global batch,
    this data-parallel rank's rows (``slice_rows``) through ``pipe.train_step``, clipping over every stage
    (``pipe.clip_grad_norm_``), ``recipe``'s optimizer. Returns ``losses`` and ``norms`` as this rank sees them,
    ``state`` (``gather_state_dict``: the whole model on rank 0, None elsewhere) and, with ``grads``, the first step's
    gradients of this rank's stages, whole and in the model's layout (``hf_dist.state_dict.hf_layout``: collective
    over the stage's tp / dp ranks), by parameter name."""
    from hf_dist.pipeline_parallel import gather_state_dict
    from hf_dist.state_dict import fused_keys, hf_layout

    params = [p for p in pipe.parameters() if p.requires_grad]
    optimizer = recipe.optimizer_for(params)
    out: dict = {"losses": [], "norms": []}
    fused = {key: parts for stage in pipe.modules for key, parts in fused_keys(stage).items()}
    for index, batch in enumerate(steps):
        out["losses"].append(float(pipe.train_step(slice_rows(batch, dp_rank, dp))))
        if grads and index == 0:
            out["grads"] = {n: hf_layout(n, p.grad, fused).clone() for stage in pipe.modules  # tied: each name
                            for n, p in stage.named_parameters(remove_duplicate=False) if p.grad is not None}
        if recipe.max_norm is not None:
            out["norms"].append(float(pipe.clip_grad_norm_(recipe.max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    out["state"] = gather_state_dict(pipe)
    return out


# -- the one comparison -------------------------------------------------------------------------------------

ROLES = {"router": ("router", ".gate."), "expert": ("experts",)}
"""Parameter-name parts of the MoE weights a comparison must reach: a router gradient can be wrong while the loss
looks right. (Norms need no rule: every key of the reference is compared, and a model may have no norm weights,
OLMo's LayerNorm.)"""


def roles(names, config) -> dict[str, list[str]]:
    """The names among ``names`` of each role in ``ROLES``; empty for a config without routed experts."""
    if num_experts(config) is None:
        return {}
    return {role: [n for n in names if any(part in n for part in parts)] for role, parts in ROLES.items()}


ADAM_NOISE = 5e-5
"""``state_atol`` after several AdamW steps on rows the batches barely train (a rare token's embedding or head row):
their gradient is at rounding level and Adam scales it to a full step, so one element can pass 1e-5 while losses,
norms and first gradients agree (a real layout error moves every element). 1.7e-5 to 3.3e-5 on the 2026-11-28 VM."""


def assert_parity(run: Mapping, ref: Mapping, *, atol: float = 1e-5, rtol: float = 0.0,
                  state_atol: float | None = None, state_rtol: float = 0.0, norm_rtol: float | None = None, config=None,
                  what: str = "") -> None:
    """``run`` equals ``ref``: losses within ``atol``; ``norms`` (when both have them) within ``rtol`` or 1e-5
    relative; ``grads`` and ``state`` (whichever both have) every tensor within ``state_atol`` (default ``atol``)
    and ``state_rtol``, with the same keys. ``config``: for a MoE config, also require a router and an expert weight
    among the compared keys (a state filtered before the call fails)."""
    label = f"{what}: " if what else ""
    assert_close(torch.tensor(run["losses"], dtype=torch.float64), torch.tensor(ref["losses"], dtype=torch.float64),
                 atol=atol, rtol=rtol, msg=lambda m: f"{label}losses: {m}")
    if run.get("norms") and ref.get("norms"):
        assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), atol=0, rtol=norm_rtol or rtol or 1e-5,
                     msg=lambda m: f"{label}grad norms: {m}")
    tol = atol if state_atol is None else state_atol
    compared = []
    for key in ("grads", "state"):
        if key not in run or key not in ref:
            continue
        got, want = run[key], ref[key]
        assert set(got) == set(want), f"{label}{key} keys differ: {sorted(set(got) ^ set(want))}"
        for name, value in want.items():
            assert_close(torch.as_tensor(got[name]).to(value.dtype), value, atol=tol, rtol=state_rtol,
                         msg=lambda m, name=name: f"{label}{key} {name}: {m}")
        compared.extend(want)
    assert compared, f"{label}neither gradients nor parameters compared"
    if config is not None:
        for role, names in roles(compared, config).items():
            assert names, f"{label}no {role} weight compared"

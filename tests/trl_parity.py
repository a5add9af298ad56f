"""The TRL trainers' side of the parity harness: a TRL trainer's logged figures and weights in
``parity.assert_parity``'s shape, for the TRL files, whose one-process reference is TRL's own trainer (or a whole run
against a resumed one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.testing import assert_close

from parity import assert_parity

__all__ = ["TRL_PARITY_LOGS", "assert_trl_parity", "trl_run"]

TRL_PARITY_LOGS = ("loss", "eval_loss", "grad_norm")
"""The logged figures ``trl_run`` hands to ``assert_parity`` (the rest are compared by ``assert_trl_parity``)."""


def trl_run(metrics: Mapping, state: Mapping[str, torch.Tensor]) -> dict:
    """``assert_parity``'s run of a TRL trainer from its logs (``{name: per-step values}``, an evaluation's figures
    as scalars) and its weights: ``loss`` per step then ``eval_loss`` where logged, ``grad_norm`` as the norms."""
    losses = list(metrics["loss"]) + ([metrics["eval_loss"]] if "eval_loss" in metrics else [])
    run = {"losses": losses, "state": state}
    if "grad_norm" in metrics:
        run["norms"] = list(metrics["grad_norm"])
    return run


def assert_trl_parity(metrics: Mapping, state: Mapping[str, torch.Tensor], ref_metrics: Mapping,
                      ref_state: Mapping[str, torch.Tensor], *, names: Sequence[str] | None = None,
                      atol: float = 1e-5, config=None, what: str = "") -> None:
    """A TRL trainer's run equals ``ref``'s: the same logged figures; losses, grad norms and every weight through
    ``assert_parity`` (``config``: a MoE's router and expert weights required); then each other figure in ``names``
    (default: every one ``ref_metrics`` has; rewards, log-probabilities, KL) within ``atol``."""
    label = f"{what}: " if what else ""
    assert set(metrics) == set(ref_metrics), f"{label}logged figures differ: {sorted(set(metrics) ^ set(ref_metrics))}"
    assert_parity(trl_run(metrics, state), trl_run(ref_metrics, ref_state), atol=atol, config=config, what=what)
    for name in (ref_metrics if names is None else names):
        if name not in TRL_PARITY_LOGS:
            assert_close(torch.tensor(metrics[name], dtype=torch.float64),
                         torch.tensor(ref_metrics[name], dtype=torch.float64), atol=atol, rtol=0,
                         msg=lambda m, name=name: f"{label}{name}: {m}")

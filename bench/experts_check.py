"""transformers' experts implementations against eager on one device: the loss, router and expert gradients.

    python bench/experts_check.py            # on CUDA when there is one, else on CPU
    python bench/experts_check.py --cpu

A loss that matches can hide a wrong router gradient (transformers#48687 reports one under EP with ``batched_mm``),
so this compares every gradient of one forward and backward of a small Qwen3-MoE (16 experts, top-4, router aux
loss coefficient 0.1, so a dropped aux term shows) with the same weights and tokens under ``eager``, ``batched_mm``
and ``grouped_mm``:
  - fp32: each implementation's gradients against eager's, relative to the largest eager gradient of that class
    (router, experts, the rest); the bound is 1e-4 (TF32 off);
  - bf16 autocast (``bf16=True`` as the Trainer runs it): each implementation's error against the fp32 eager run,
    beside eager-bf16's own; the bound is 2x eager-bf16's error (an implementation may round differently, not worse).
``bench/gpu_check.py`` runs it as its section 4; ``tests/test_gpu_check.py`` runs it on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
FP32_BOUND = 1e-4
BF16_FACTOR = 2.0


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, output_router_logits=True,
                          router_aux_loss_coef=0.1, tie_word_embeddings=False, attn_implementation="sdpa")


def _class(name: str) -> str:
    if ".mlp.gate." in name:
        return "router"
    return "experts" if ".experts." in name else "rest"


def gradients(implementation: str, state: dict, device: torch.device, bf16: bool) -> tuple[float, dict]:
    """One forward and backward (loss with the router aux term) under ``implementation``: the loss and every grad."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32,
                                                 experts_implementation=implementation)
    model.load_state_dict(state)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(1)).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


def _errors(grads: dict, ref: dict) -> dict[str, float]:
    worst: dict[str, float] = {}
    scale: dict[str, float] = {}
    for name, g in ref.items():
        kind = _class(name)
        scale[kind] = max(scale.get(kind, 0.0), g.abs().max().item())
        worst[kind] = max(worst.get(kind, 0.0), (grads[name] - g).abs().max().item())
    return {kind: worst[kind] / scale[kind] for kind in worst}


def rows(device: torch.device) -> tuple[list[str], bool]:
    """The table's lines and whether every implementation is within its bound (a failed run counts as not)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).state_dict()
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref_loss, ref = gradients("eager", state, device, bf16=False)
        found = {}
        for bf16 in (False, True):
            for impl in IMPLEMENTATIONS:
                try:
                    found[impl, bf16] = gradients(impl, state, device, bf16)
                except Exception as err:  # noqa: BLE001 -- a row saying what failed
                    found[impl, bf16] = f"{type(err).__name__}: {err}".splitlines()[0][:160]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    lines = [f"{'implementation':<24}{'loss - eager fp32':>18}{'router':>10}{'experts':>10}{'rest':>10}"
             f"{'bound':>10}  within"]
    eager_bf16 = found["eager", True]
    bf16_errors = _errors(eager_bf16[1], ref) if not isinstance(eager_bf16, str) else None
    ok = True
    for (impl, bf16), result in found.items():
        label = f"{impl} {'bf16 autocast' if bf16 else 'fp32'}"
        if isinstance(result, str):
            lines.append(f"{label:<24}FAILED: {result}")
            ok = False
            continue
        errors = _errors(result[1], ref)
        if bf16:
            bound = {k: BF16_FACTOR * v for k, v in bf16_errors.items()} if bf16_errors else None
        else:
            bound = {k: FP32_BOUND for k in errors}
        within = bound is not None and all(errors[k] <= max(bound[k], FP32_BOUND) for k in errors)
        ok = ok and within
        shown = max(bound.values()) if bound else float("nan")
        lines.append(f"{label:<24}{result[0] - ref_loss:>18.2e}{errors['router']:>10.2e}{errors['experts']:>10.2e}"
                     f"{errors['rest']:>10.2e}{shown:>10.1e}  {'yes' if within else 'NO'}")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA is available")
    opts = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.cpu else "cpu")
    lines, ok = rows(device)
    print(f"experts implementations against eager on {device.type} (gradients relative to the largest of each class)")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

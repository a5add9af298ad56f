"""One command for a GPU: what hf_dist claims about memory and speed, measured on one CUDA device in minutes.

    python bench/gpu_check.py                 # or: make gpu-check; writes docs/gpu_check.md
    python bench/gpu_check.py --cpu-smoke     # the same code paths at toy sizes on CPU, in seconds (no meaning)

Sections, each row one training run (fresh process on CUDA, so each peak is its own), bf16 (``bf16=True``: fp32
weights under autocast, as one device trains), AdamW, no activation checkpointing, random tokens:
  1. a Llama-3.2-1B-shaped model built from its config (no download): the plain ``transformers.Trainer`` and
     ``DistTrainer`` with the whole loss (eager), the chunked loss (its default), per-block ``torch.compile`` and
     FSDP2 on one rank (a process group of one: FSDP2's units and buffers, nothing to shard);
     peak memory allocated / reserved (``torch.cuda.max_memory_allocated/reserved``) beside the planner's forecast
     for the same shape, batch and precision (``hf_dist.planner``, the functions ``hf-dist plan`` runs: chunked
     loss for DistTrainer, whole loss for the Trainer), tokens/s and MFU (``hf_dist.planner.flops``: model FLOPs
     over the device peak; ``trainer MFU``: what ``DistTrainer`` logs with ``dist_logging``);
  2. a 2-layer slice shaped like Qwen3-30B-A3B (128 experts, top-8) with each of transformers' experts
     implementations (``eager``, ``batched_mm``, ``grouped_mm``) under DistTrainer: tokens/s, MFU on the active
     parameters (the experts counted k/E);
  3. ``hf-dist plan --calibrate`` (one device, a 2-layer model) for the section-1 shape: its forecast step time
     beside the measured DistTrainer (chunked loss) step, and the assumed-efficiency forecast beside both.
A run that fails is a row saying so (the others still run); the exit code is then 1.

Without CUDA it refuses (exit 2) unless ``--cpu-smoke`` is given; ``tests/test_gpu_check.py`` runs the smoke mode so
the script cannot rot while no GPU is at hand.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "docs", "gpu_check.md")


@dataclass(frozen=True)
class Sizes:
    llama: dict
    moe: dict
    seq: int
    micro: int
    warmup: int
    steps: int


GPU = Sizes(
    llama=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0, max_position_embeddings=8192),
    moe=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
             num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=8192,
             output_router_logits=True, router_aux_loss_coef=0.001),
    seq=2048, micro=2, warmup=3, steps=6)
SMOKE = Sizes(
    llama=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    moe=dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01),
    seq=32, micro=2, warmup=1, steps=2)

CASES: dict[str, dict] = {
    "trainer": {"model": "llama", "label": "Trainer (whole loss)", "plain": True},
    "dist_whole": {"model": "llama", "label": "DistTrainer eager, whole loss", "args": {"chunked_loss": False}},
    "dist_chunked": {"model": "llama", "label": "DistTrainer eager, chunked loss", "args": {}},
    "dist_compiled": {"model": "llama", "label": "DistTrainer compiled, chunked", "args": {"torch_compile": True}},
    # FSDP2 on one rank (a process group of one, its own process): FSDP2's buffers and units, nothing sharded
    "dist_fsdp2": {"model": "llama", "label": "DistTrainer FSDP2, chunked", "group": True,
                   "args": {"fsdp": "full_shard", "fsdp_config": {"version": 2}}},
    "moe_eager": {"model": "moe", "label": "experts eager", "experts": "eager", "args": {}},
    "moe_batched_mm": {"model": "moe", "label": "experts batched_mm", "experts": "batched_mm", "args": {}},
    "moe_grouped_mm": {"model": "moe", "label": "experts grouped_mm", "experts": "grouped_mm", "args": {}},
}


def _config(name: str, sizes: Sizes):
    from transformers import LlamaConfig, Qwen3MoeConfig

    cls = LlamaConfig if name == "llama" else Qwen3MoeConfig
    return cls(**getattr(sizes, name), attn_implementation="sdpa")


def _device(smoke: bool) -> torch.device:
    return torch.device("cpu" if smoke else "cuda")


def _peak_flops(device: torch.device) -> tuple[float, str]:
    from hf_dist.planner.calibrate import device_peak_flops

    return device_peak_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _dataset(rows: int, sizes: Sizes, vocab: int) -> list[dict]:
    """Random token rows as a plain list of examples (the Trainer takes any sized dataset; no ``datasets`` needed)."""
    ids = torch.randint(0, vocab, (rows, sizes.seq), generator=torch.Generator().manual_seed(0)).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(case: str, model, sizes: Sizes, out: str, device: torch.device, peak: float, callbacks: list):
    from transformers import Trainer, TrainingArguments

    from hf_dist import DistTrainer, DistTrainingArguments

    spec, smoke = CASES[case], device.type == "cpu"
    common = dict(output_dir=out, max_steps=sizes.warmup + sizes.steps, per_device_train_batch_size=sizes.micro,
                  bf16=True, learning_rate=1e-5, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                  report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0, use_cpu=smoke)
    data = _dataset(sizes.micro * (sizes.warmup + sizes.steps), sizes, model.config.vocab_size)
    if spec.get("plain"):
        return Trainer(model=model, args=TrainingArguments(**common), train_dataset=data, callbacks=callbacks)
    extra = dict(spec["args"])
    if extra.get("torch_compile") and smoke:
        extra["torch_compile_backend"] = "eager"  # dynamo's path without inductor's C++ build: seconds, not minutes
    args = DistTrainingArguments(**common, **extra, global_batch_size=sizes.micro, dist_logging=True,
                                 peak_tflops=peak / 1e12)
    return DistTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def run_case(case: str, smoke: bool, chunk_tokens: int | None = None) -> dict:
    """One training run of ``case`` in this process: step time, rates and peak memory (``chunk_tokens``: the
    chunked loss's tokens per chunk in place of its policy's, to measure the policy)."""
    from transformers import AutoModelForCausalLM, TrainerCallback, logging as hf_logging

    if chunk_tokens:
        import hf_dist.loss.chunked

        hf_dist.loss.chunked.chunk_tokens_for = lambda vocab, hidden: chunk_tokens

    from hf_dist.planner.flops import module_flop_counts

    hf_logging.set_verbosity_error()
    spec, sizes, device = CASES[case], SMOKE if smoke else GPU, _device(smoke)
    if spec.get("group"):  # a process group of one rank, as a launcher would describe it
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                               WORLD_SIZE="1").items():
            os.environ.setdefault(key, value)
    peak, _ = _peak_flops(device)
    torch.manual_seed(0)
    experts = {"experts_implementation": spec["experts"]} if "experts" in spec else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(spec["model"], sizes), dtype=torch.float32, **experts)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            _sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            _sync(device)
            times.append(time.perf_counter() - self.start)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="hf_dist_gpu_check_") as out:
        trainer = _trainer(case, model, sizes, out, device, peak, [Timer()])
        trainer.train()
    if spec.get("group"):  # measured as FSDP2, not as a layout it fell back to
        from torch.distributed.fsdp import FSDPModule

        if not any(isinstance(m, FSDPModule) for m in trainer.model.modules()):
            raise RuntimeError(f"{case}: the trained model has no FSDP2 unit ({type(trainer.model).__name__})")
    step = statistics.median(times[sizes.warmup:])
    tokens = sizes.micro * sizes.seq
    model_flops, _ = module_flop_counts(model).per_token(sizes.seq)
    logs = trainer.state.log_history
    logged_mfu = [log["mfu"] for log in logs if "mfu" in log][sizes.warmup:]
    return {"step_s": step, "tokens_per_s": tokens / step, "mfu": model_flops * tokens / (step * peak),
            "trainer_mfu": statistics.median(logged_mfu) if logged_mfu else None,
            "loss": next(log["loss"] for log in logs if "loss" in log),
            "allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "reserved": torch.cuda.max_memory_reserved() if device.type == "cuda" else None}


def measure(case: str, smoke: bool, isolate: bool) -> dict:
    """``run_case`` here, or in a fresh process (``isolate``; always for a case with a process group, which would
    outlive the run in this one); a failure is returned as ``{"error": ...}``."""
    if not isolate and not CASES[case].get("group"):
        try:
            return run_case(case, smoke)
        except Exception as err:  # noqa: BLE001 -- a row saying what failed; the other rows still run
            return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:200]}
    cmd = [sys.executable, os.path.abspath(__file__), "--one", case] + (["--cpu-smoke"] if smoke else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {last[:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plan_argv(model_dir: str, sizes: Sizes, gpu: str) -> list[str]:
    return ["plan", "--model", model_dir, "--gpus", "1", "--gpu", gpu, "--seq-len", str(sizes.seq), "--micro-batch",
            str(sizes.micro), "--global-batch", str(sizes.micro), "--precision", "bf16",
            "--no-activation-checkpointing", "--json"]


def _run_plan(argv: list[str]) -> dict:
    """``hf-dist plan ... --json`` (this package's command line, in this process); the chosen candidate."""
    from hf_dist.cli import main as hf_dist_main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = hf_dist_main(argv)
    if code:
        raise RuntimeError(f"hf-dist {' '.join(argv)} exited {code}: {stderr.getvalue().strip()[-300:]}")
    plan = json.loads(stdout.getvalue())
    return next(c for c in plan["candidates"] if c["name"] == plan["chosen"]) | {"stderr": stderr.getvalue()}


def forecasts(sizes: Sizes, gpu: str, calibrate: bool) -> dict:
    """The planner's memory (chunked and whole loss) and step-time forecasts for the section-1 shape."""
    import dataclasses

    from hf_dist.planner import Workload, estimate_memory, model_spec

    with tempfile.TemporaryDirectory(prefix="hf_dist_gpu_check_cfg_") as model_dir:
        _config("llama", sizes).save_pretrained(model_dir)
        assumed = _run_plan(_plan_argv(model_dir, sizes, gpu))
        calibrated = None
        if calibrate:
            try:
                calibrated = _run_plan(_plan_argv(model_dir, sizes, gpu) + ["--calibrate", "--calibrate-ranks", "1"])
            except Exception as err:  # noqa: BLE001 -- the table says so; the measurements are kept
                calibrated = {"error": f"{type(err).__name__}: {err}"[:300]}
        spec = model_spec(model_dir)
        for found in (assumed, calibrated):  # the model is named by its temporary folder
            if found and "throughput" in found:
                found["throughput"]["efficiency_source"] = found["throughput"]["efficiency_source"].replace(
                    model_dir, "model")
    from hf_dist.planner import MemoryAssumptions, make_layout

    layout = make_layout(assumed["strategy"], 1)
    workload = Workload(seq_len=sizes.seq, micro_batch_size=sizes.micro, precision=assumed["precision"],
                        attention="sdpa", activation_checkpointing=False, chunked_loss=True)
    whole = estimate_memory(spec, dataclasses.replace(workload, chunked_loss=False), layout, MemoryAssumptions())
    fsdp2 = estimate_memory(spec, workload, make_layout("fsdp_full_shard", 1), MemoryAssumptions())
    return {"chunked": assumed["memory"], "whole": {"allocated": whole.allocated, "reserved": whole.reserved},
            "fsdp2": {"allocated": fsdp2.allocated, "reserved": fsdp2.reserved},
            "assumed": assumed["throughput"], "calibrated": calibrated and calibrated.get("throughput", calibrated),
            "layout": assumed["name"], "precision": assumed["precision"], "gpu": gpu}


def _gib(n) -> str:
    return f"{n / 2**30:.3g}" if isinstance(n, (int, float)) else "-"


def table(results: dict[str, dict], plan: dict, sizes: Sizes) -> list[str]:
    head = (f"{'run':<32}{'step ms':>9}{'tokens/s':>11}{'MFU':>7}{'trainer MFU':>13}{'alloc GiB':>11}"
            f"{'reserved':>10}{'plan alloc':>12}{'plan resv':>11}")
    lines = [f"1. {sizes.llama['hidden_size']}-hidden {sizes.llama['num_hidden_layers']}-layer Llama, micro "
             f"{sizes.micro} x {sizes.seq} tokens, bf16 ({plan.get('precision', '-')}), planner layout "
             f"{plan.get('layout', '-')} (the FSDP2 row: fsdp_full_shard) on {plan.get('gpu', '-')}", head]
    moe_head = False
    for case, r in sorted(results.items(), key=lambda item: CASES[item[0]]["model"] != "llama"):  # section 1 first
        spec = CASES[case]
        if spec["model"] == "moe" and not moe_head:
            moe_head, m = True, sizes.moe
            lines += ["", f"2. Qwen3-30B-A3B-shaped slice: {m['num_hidden_layers']} layers, {m['num_experts']} "
                      f"experts top-{m['num_experts_per_tok']}, DistTrainer, MFU on active parameters", head]
        if "error" in r:
            lines.append(f"{spec['label']:<32}FAILED: {r['error']}")
            continue
        chunked = not spec.get("plain") and spec["args"].get("chunked_loss", True)
        kind = "fsdp2" if spec.get("group") else "chunked" if chunked else "whole"
        mem = plan.get(kind, {}) if spec["model"] == "llama" else {}
        tmfu = f"{r['trainer_mfu']:.1%}" if r["trainer_mfu"] is not None else "-"
        lines.append(f"{spec['label']:<32}{r['step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>11.0f}{r['mfu']:>7.1%}"
                     f"{tmfu:>13}{_gib(r['allocated']):>11}{_gib(r['reserved']):>10}"
                     f"{_gib(mem.get('allocated')):>12}{_gib(mem.get('reserved')):>11}")
    measured = results.get("dist_chunked", {})
    lines += ["", "3. hf-dist plan (1 GPU, same shape and batch) against the measured DistTrainer step (chunked loss)"]
    if "error" in plan:
        lines.append(f"   planner FAILED: {plan['error']}")
    for name in ("assumed", "calibrated"):
        t = plan.get(name)
        if not t:
            continue
        if "error" in t:
            lines.append(f"   {name:<11} FAILED: {t['error']}")
            continue
        vs = f"{t['step_time_s'] / measured['step_s']:.2f}x measured" if "step_s" in measured else "no measurement"
        lines.append(f"   {name:<11} efficiency {t['efficiency']:.1%}: step {t['step_time_s'] * 1e3:.4g} ms, "
                     f"MFU {t['mfu']:.1%} ({vs}); {t['efficiency_source']}")
    if "step_s" in measured:
        lines.append(f"   measured    step {measured['step_s'] * 1e3:.1f} ms, MFU {measured['mfu']:.1%}")
    return lines


def _gpu_kind(smoke: bool) -> str:
    """The planner's GPU kind for this device (the smoke run plans for an H100; an unknown GPU too, said)."""
    from hf_dist.cli.plan import local_gpu_kind

    if smoke:
        return "h100"
    try:
        return local_gpu_kind()
    except ValueError as err:
        print(f"{err}; planning for an h100", file=sys.stderr)
        return "h100"


def _header(device: torch.device, peak: float, peak_source: str, smoke: bool) -> str:
    import transformers

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run (toy sizes; figures mean nothing)"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{when}, {name}, peak {peak / 1e12:.1f} TFLOP/s ({peak_source}); torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def write_doc(path: str, header: str, lines: list[str]) -> None:
    text = ("# GPU check\n\nWritten by `python bench/gpu_check.py` (`make gpu-check`); what each row measures is in "
            "that script's docstring.\n\n" + header + "\n\n```\n" + "\n".join(lines) + "\n```\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run every section at toy sizes on CPU")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--out", default=None, help="markdown file to write (default on CUDA: docs/gpu_check.md)")
    parser.add_argument("--isolate", choices=("yes", "no"), default=None,
                        help="each run in a fresh process (default: yes on CUDA, no with --cpu-smoke)")
    parser.add_argument("--no-calibrate", action="store_true", help="skip hf-dist plan --calibrate")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one case, JSON on stdout (isolated runs)
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="with --one: the chunked loss's tokens per chunk (default: its policy's)")
    opts = parser.parse_args(argv)
    if not opts.cpu_smoke and not torch.cuda.is_available():
        print(f"bench/gpu_check.py: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is "
              f"False): this check measures a GPU. Run it on a machine with one, or pass --cpu-smoke to run the same "
              f"code paths at toy sizes on CPU (the figures then mean nothing).", file=sys.stderr)
        return 2
    if opts.one:
        print(json.dumps(run_case(opts.one, opts.cpu_smoke, opts.chunk_tokens)))
        return 0
    cases = [c for c in opts.cases.split(",") if c]
    if unknown := sorted(set(cases) - set(CASES)):
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    sizes, device = SMOKE if opts.cpu_smoke else GPU, _device(opts.cpu_smoke)
    isolate = (opts.isolate or ("no" if opts.cpu_smoke else "yes")) == "yes"
    peak, peak_source = _peak_flops(device)
    header = _header(device, peak, peak_source, opts.cpu_smoke)
    print(header, flush=True)
    results = {}
    for case in cases:
        results[case] = measure(case, opts.cpu_smoke, isolate)
        print(f"{case}: {results[case]}", flush=True)
    try:
        plan = forecasts(sizes, _gpu_kind(opts.cpu_smoke), calibrate=not opts.no_calibrate)
    except Exception as err:  # noqa: BLE001 -- the measurements are kept and written
        plan = {"error": f"{type(err).__name__}: {err}"[:300]}
    lines = table(results, plan, sizes)
    sys.path.insert(0, HERE)
    import experts_check

    experts_lines, experts_ok = experts_check.rows(device)
    lines += ["", f"4. experts implementations against eager on this device ({experts_check.__doc__.splitlines()[0]})",
              *experts_lines]
    print("\n" + "\n".join(lines))
    out = opts.out or (None if opts.cpu_smoke else DEFAULT_OUT)
    if out:
        write_doc(out, header, lines)
        print(f"written to {out}")
    failed = [r for r in (*results.values(), plan, plan.get("calibrated") or {}) if "error" in r]
    return 1 if failed or not experts_ok else 0


if __name__ == "__main__":
    sys.exit(main())

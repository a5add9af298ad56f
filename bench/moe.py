"""Expert-parallel layouts on one MoE model: optimizer step time and per-rank memory, one row per layout hf_dist runs
(and transformers' own EP x FSDP2 beside them).

    flock /tmp/hf_dist_cpu.lock python bench/moe.py [--rounds 1] [--steps 4] [--layouts fsdp2,ep2_fsdp2,...]

The model is ``bench/native.py``'s tiny Qwen3-MoE (hidden 256, 4 layers, 8 experts of width 256, top-2, router aux
loss 0.01, vocabulary 2,048: ~8.1 M parameters, ~6.3 M in experts), written with ``save_pretrained`` and loaded as
users load theirs. Every row is a fresh spawn of gloo ranks (CPU) training it through the public path:
``hf_dist.from_pretrained(dir, args)`` then ``DistTrainer`` with ``DistTrainingArguments`` (AdamW, constant lr,
clipping at 1.0, no checkpoints); the ``native`` row is ``bench/native.py``'s own: ``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))`` trained by ``transformers.Trainer``. Every data-parallel
rank takes 4 sequences of 128 tokens per optimizer step (``EP2 x CP2``: 1 sequence of 512 tokens, split over the 2 cp
ranks), so every row trains 1,024 tokens per step; ``EP2 x PP2`` runs them as the pipeline's micro-batches.

Rows (``--layouts``): ``fsdp2`` (2 ranks, every rank runs every expert, FSDP2 FULL_SHARD), ``ep2_fsdp2`` (2 ranks,
4 experts per rank, the rest FSDP2), ``ep2_ddp`` (2 ranks, 4 experts per rank, the rest replicated), ``native`` (2
ranks, transformers' EP2 x FSDP2), ``ep2_pp2`` (4 ranks: 2 stages x 2 data-parallel ranks, each stage's experts over its
2 ranks, FSDP2), ``ep2_cp2`` (4 ranks: 2 data-parallel x 2 cp, experts over the dp ranks, FSDP2), ``ep2_tp2`` (4
ranks: attention split by TP, experts by EP, FSDP2).
Columns: ``step ms``: the median optimizer step (the whole ``Trainer`` step: data, forward, backward, clipping,
AdamW; each step timed on every rank, the slowest rank's time kept) after 2 warm-up steps, pooled over rounds;
``tokens/step``: the tokens one optimizer step trains (all ranks); ``states MiB/rank``: parameters + gradients + AdamW
states the worst rank holds (its local shards, counted from the tensors the optimizer steps, after the step);
``peak RSS MiB/rank``: the worst rank's peak resident memory (``VmHWM``: Python, torch, the model, activations and the
allocator's slack). Not a test: nothing is asserted.

Measured 2026-11-27 on the 2-core x86_64 CPU machine (no GPU), gloo, shared with a running test suite (load average
5.6), default arguments (1 round of 4 measured steps; 4-rank rows put 4 processes on the 2 cores):

    layout               ranks   step ms  tokens/step  states MiB/rank  peak RSS MiB/rank
    FSDP2                    2     444.9         1024             62.1                726
    EP2 x FSDP2              2     461.7         1024             62.1                663
    EP2 x DDP                2     314.1         1024             76.2                663
    native EP2 x FSDP2       2     286.9         1024             62.1                684
    EP2 x PP2                4     715.7         1024             31.0                597
    EP2 x CP2                4     788.8         1024             31.0                646
    EP2 x TP2                4    1174.3         1024             33.1                648

CPU step times do not transfer to GPUs: here gloo's all-to-all and all-gather run over shared memory on 2 loaded
cores, and the 4-rank rows oversubscribe them, so step times compare rows of one world size at most, and move by
tens of percent between runs (an earlier run of the same command: EP2 x FSDP2 560, native 522, EP2 x PP2 558 ms). The
states column is exact and does transfer: EP with expert-FSDP degree 1 gives each rank half the experts whole, so
EP2 x FSDP2 holds what FSDP2 holds; EP2 x DDP adds the replicated dense part; PP2, CP2 and TP2 split over 4 ranks.
Peak RSS is mostly what every process holds (Python, torch, transformers), not the model. No GPU was lent here.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import native  # noqa: E402  (bench/native.py: the timing and transformers' EP side)
import native_cases  # noqa: E402  (tests/native_cases.py: the model, the data, the common arguments)


@dataclass(frozen=True, kw_only=True)
class Row:
    label: str
    world: int
    args: dict = field(default_factory=dict)
    """``DistTrainingArguments`` layout fields; empty for the native row."""
    micro: int = native_cases.MICRO
    seq: int = native_cases.SEQ


FSDP2 = dict(fsdp2=True)
LAYOUTS = {
    "fsdp2": Row(label="FSDP2", world=2, args=FSDP2),
    "ep2_fsdp2": Row(label="EP2 x FSDP2", world=2, args=dict(ep_size=2, **FSDP2)),
    "ep2_ddp": Row(label="EP2 x DDP", world=2, args=dict(ep_size=2)),
    "native": Row(label="native EP2 x FSDP2", world=2),
    "ep2_pp2": Row(label="EP2 x PP2", world=4, args=dict(ep_size=2, pp_size=2, **FSDP2)),
    "ep2_cp2": Row(label="EP2 x CP2", world=4, args=dict(ep_size=2, cp_size=2, **FSDP2), micro=1, seq=512),
    "ep2_tp2": Row(label="EP2 x TP2", world=4, args=dict(ep_size=2, tp_size=2, **FSDP2)),
}


def _dp(row: Row) -> int:
    return row.world // (row.args.get("pp_size", 1) * row.args.get("cp_size", 1) * row.args.get("tp_size", 1))


def _state_bytes(optimizer) -> int:
    def size(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for group in optimizer.param_groups for p in group["params"]]
    total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in params)
    for state in optimizer.state.values():
        total += sum(size(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def _hf_dist_trainer(row: Row, model_dir: str, out: str, max_steps: int, callbacks: list):
    import hf_dist
    from hf_dist import DistTrainer, DistTrainingArguments

    common = {**native_cases.common_args(out, max_steps), "per_device_train_batch_size": row.micro}
    args = DistTrainingArguments(**common, global_batch_size=row.micro * _dp(row), **row.args)
    return DistTrainer(model=hf_dist.from_pretrained(model_dir, args), args=args,
                       train_dataset=native_cases.dataset(64, row.seq), callbacks=callbacks)


def _rank(rank: int, world: int, name: str, model_dir: str, steps: int) -> dict:
    from transformers import TrainerCallback

    row, states = LAYOUTS[name], []

    class States(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            states.append(_state_bytes(optimizer))  # after the step, before the gradients are dropped

    def make(out, max_steps, callbacks):
        callbacks = callbacks + [States()]
        if name == "native":
            return native._trainer("native", "ep2", model_dir, out, max_steps, world, callbacks)
        return _hf_dist_trainer(row, model_dir, out, max_steps, callbacks)

    result = native.timed_train(make, steps)
    result["states_mib"] = native._max_over_ranks(max(states)) / 2**20
    return result


def main(argv: list[str] | None = None) -> None:
    from dist_utils import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run (after 2 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per layout, the layouts interleaved")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {','.join(LAYOUTS)}")
    opts = parser.parse_args(argv)
    names = [n for n in opts.layouts.split(",") if n]
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hf_dist_moe_") as folder:
        model_dir = native_cases.write_models(folder, names=("moe",))["moe"]
        for i in range(opts.rounds):
            for name in names:
                runs[name].append(run_distributed(_rank, LAYOUTS[name].world, name, model_dir, opts.steps,
                                                  timeout_s=1800)[0])
                print(f"round {i + 1} {name} done", flush=True)
    print(f"\n{datetime.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, gloo, torch "
          f"{torch.__version__}, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after; "
          f"{opts.rounds} round(s) of {opts.steps} measured steps")
    print(f"{'layout':<20}{'ranks':>6}{'step ms':>10}{'tokens/step':>13}{'states MiB/rank':>17}"
          f"{'peak RSS MiB/rank':>19}")
    for name, results in runs.items():
        row = LAYOUTS[name]
        step = statistics.median(t for r in results for t in r["times"]) * 1e3
        states = max(r["states_mib"] for r in results)
        peak = max(r["peak_mib"] for r in results)
        tokens = row.micro * row.seq * _dp(row)
        print(f"{row.label:<20}{row.world:>6}{step:>10.1f}{tokens:>13}{states:>17.1f}{peak:>19.0f}")


if __name__ == "__main__":
    main()

"""hf_dist vs the plain stack on the same work: DistTrainer FSDP2 (and EP2 x FSDP2) vs transformers' native
``DistributedConfig`` on 2 gloo ranks, and DistTrainer vs the plain ``Trainer`` on one process.

    flock /tmp/hf_dist_cpu.lock python bench/native.py [--rounds 4] [--steps 8] [--pairs fsdp2,ep2,one] [--ledger]

Every run is a fresh spawn that loads the model as its users do (a checkpoint written with ``save_pretrained``); the
sides, models and data are ``tests/native_cases.py``'s: ``native`` (transformers' ``DistributedConfig`` and
``Trainer``), ``hf_dist`` (``hf_dist.from_pretrained`` and ``DistTrainer``: FSDP2, ``ep_size=2`` for the MoE, the
chunked loss on, its default), ``plain`` (``Trainer`` on one process). Pairs: ``fsdp2``, ``ep2`` (2 gloo ranks);
``one`` (one process, DistTrainer vs Trainer); ``*_whole``: DistTrainer with ``chunked_loss=False`` (the
Trainer's loss path), which separates the chunked loss's cost; ``load``: the FSDP2 pair on a 254 M-parameter Llama
(vocabulary 32,000), one step only (its time is the first step's, warm-up included): what loading costs.
A round runs each pair once, the pair's order alternating between rounds, so both sides share the machine's
noise; the ratio is hf_dist's median step over the other side's median step in the same round, reported as the
median and range over rounds. ``load MiB``: the rank's peak RSS (``VmHWM``) once the model is loaded and laid out,
before training; ``peak MiB``: after the last step; both the worst rank's. ``CPU ms/step``: each step's
``process_time`` summed over the ranks, the work done without the waits (a gloo rank waits asleep), which other jobs'
noise moves less than the wall time. ``--ledger`` adds, per pair, what each
side's step communicates and computes (round 1's last warm-up step, rank 0): the counts that explain a ratio.
Not a test: the timings are not asserted; the ledger's comparison is, in ``tests/test_native_ledger.py``.
Figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from native_cases import LLAMA, MICRO, MOE, SEQ, build_trainer, ledger_rows, write_models  # noqa: E402

WARMUP = 2
PAIRS = {
    "fsdp2": {"world": 2, "model": "llama", "sides": ("native", "hf_dist")},
    "fsdp2_whole": {"world": 2, "model": "llama", "sides": ("native", "hf_dist"), "args": {"chunked_loss": False}},
    "ep2": {"world": 2, "model": "moe", "sides": ("native", "hf_dist")},
    "one": {"world": 1, "model": "llama", "sides": ("plain", "hf_dist")},
    "one_whole": {"world": 1, "model": "llama", "sides": ("plain", "hf_dist"), "args": {"chunked_loss": False}},
    "load": {"world": 2, "model": "big", "sides": ("native", "hf_dist"), "warmup": 0, "steps": 1},
    "load_whole": {"world": 2, "model": "big", "sides": ("native", "hf_dist"), "warmup": 0, "steps": 1,
                   "args": {"chunked_loss": False}},
}
LABELS = {"fsdp2": "FSDP2, 2 ranks", "fsdp2_whole": "FSDP2, whole loss", "ep2": "EP2 x FSDP2, 2 ranks",
          "one": "one process",
          "one_whole": "one, whole loss", "load": "FSDP2 load, 2 ranks",
          "load_whole": "load, whole loss"}


def _trainer(side: str, pair: str, model_dir: str, out: str, steps: int, world: int, callbacks: list):
    """The trainer of ``side`` with its model loaded and laid out (``tests/native_cases.py``)."""
    return build_trainer(side, model_dir, out, steps, world, callbacks, ep=pair == "ep2", args=PAIRS[pair].get("args"))


def peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``: a spawned rank's own, not its parent's), in MiB."""
    from hf_dist.planner.measure import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _max_over_ranks(value: float, op: str = "MAX") -> float:
    import torch.distributed as dist

    t = torch.tensor(float(value))
    if dist.is_initialized():
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return float(t)


def timed_train(make_trainer, steps: int, warmup: int = WARMUP, ledger: bool = False) -> dict:
    """Build a trainer with ``make_trainer(output_dir, max_steps, callbacks)`` and train it ``warmup + steps`` optimizer
    steps: the measured steps' times (each the slowest rank's) and CPU times (``process_time``, summed over the ranks:
    the work done, without the time spent waiting for a peer, which gloo spends asleep), load and final peak RSS (the
    worst rank's), losses.
    ``ledger``: also count the last warm-up step's collectives and FLOPs on this rank (``attach_ledger``; the timed
    steps run without it)."""
    from transformers import TrainerCallback, logging as hf_logging

    from hf_dist.metrics.ledger import attach_ledger

    hf_logging.set_verbosity_error()
    times: list[float] = []
    cpu: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)
            cpu.append(time.process_time() - self.cpu)

    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(out, warmup + steps, [Timer()])
        counted = attach_ledger(trainer, step=warmup) if ledger and warmup >= 2 else None
        load = _max_over_ranks(peak_rss_mib())
        trainer.train()
    slowest = [_max_over_ranks(t) for t in times[warmup:]]
    work = [_max_over_ranks(t, "SUM") for t in cpu[warmup:]]
    peak = _max_over_ranks(peak_rss_mib())
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    out = {"times": slowest, "cpu": work, "load_mib": load, "peak_mib": peak, "losses": losses}
    if counted is not None:
        out["ledger"] = ledger_rows(counted.ledger)
    return out


def run_side(rank: int, world: int, side: str, pair: str, model_dir: str, steps: int, warmup: int = WARMUP,
             ledger: bool = False) -> dict:
    """One fresh run of ``side``: step times (the slowest rank's), load and final peak RSS (the worst rank's)."""
    return timed_train(lambda out, max_steps, callbacks: _trainer(side, pair, model_dir, out, max_steps, world,
                                                                  callbacks), steps, warmup, ledger)


def _alone(side: str, pair: str, model_dir: str, steps: int, ledger: bool = False) -> dict:
    torch.set_num_threads(1)  # as run_distributed's ranks
    return run_side(0, 1, side, pair, model_dir, steps, ledger=ledger)


def run_pair(pair: str, dirs: dict[str, str], steps: int, order: tuple[str, str],
             ledger: bool = False) -> dict[str, dict]:
    """Each side of ``pair`` in fresh processes: gloo ranks, or one process with no process group."""
    from concurrent.futures import ProcessPoolExecutor

    import torch.multiprocessing as mp
    from dist_utils import run_distributed

    spec, out = PAIRS[pair], {}
    steps, warmup = spec.get("steps", steps), spec.get("warmup", WARMUP)
    for side in order:
        if spec["world"] == 1:
            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                out[side] = pool.submit(_alone, side, pair, dirs[spec["model"]], steps, ledger).result()
        else:
            out[side] = run_distributed(run_side, spec["world"], side, pair, dirs[spec["model"]], steps, warmup,
                                        ledger, timeout_s=1800)[0]
    return out


def summarise(rounds: list[dict[str, dict]], base: str) -> dict:
    """Median step per side (pooled), the per-round ratio hf_dist/base (median, min, max), memory (worst run)."""
    out = {}
    for key, prefix in (("times", ""), ("cpu", "cpu_")):
        ratios = [statistics.median(r["hf_dist"][key]) / statistics.median(r[base][key]) for r in rounds]
        out.update({f"{prefix}ratio": statistics.median(ratios), f"{prefix}lo": min(ratios),
                    f"{prefix}hi": max(ratios)})
    for side in (base, "hf_dist"):
        out[side] = {"step_ms": 1e3 * statistics.median([t for r in rounds for t in r[side]["times"]]),
                     "cpu_ms": 1e3 * statistics.median([t for r in rounds for t in r[side]["cpu"]]),
                     "load_mib": max(r[side]["load_mib"] for r in rounds),
                     "peak_mib": max(r[side]["peak_mib"] for r in rounds),
                     "loss": rounds[0][side]["losses"][0]}
    first = rounds[0]
    out["loss_diff"] = max(abs(a - b) for a, b in zip(first["hf_dist"]["losses"], first[base]["losses"]))
    return out


def table(results: dict[str, dict], rounds: int) -> list[str]:
    lines = [f"{'work':<22}{'side':<10}{'step ms':>9}{'load MiB':>10}{'peak MiB':>10}{'loss 1':>9}"
             f"{'max loss diff':>15}{'hf_dist/other (range)':>24}"]
    for pair, s in results.items():
        base = PAIRS[pair]["sides"][0]
        for side in (base, "hf_dist"):
            r = s[side]
            ratio = f"{s['ratio']:.2f} ({s['lo']:.2f}-{s['hi']:.2f})" if side == "hf_dist" else ""
            diff = f"{s['loss_diff']:.1e}" if side == "hf_dist" else ""
            lines.append(f"{LABELS[pair] if side == base else '':<22}{side:<10}{r['step_ms']:>9.1f}"
                         f"{r['load_mib']:>10.0f}{r['peak_mib']:>10.0f}{r['loss']:>9.4f}{diff:>15}{ratio:>24}")
    lines.append("loss 1: the first step's loss; max loss diff: the largest |difference| of the logged losses over the "
                 "run's steps (round 1)")
    if {"load", "load_whole"} & set(results):
        lines.append("load pairs: one step only, the first (its time includes the warm-up)")
    lines.append(f"ratio: median step of hf_dist over the other side's in the same round, median (min-max) of "
                 f"{rounds} interleaved rounds")
    lines.append("")
    lines.append(f"{'work':<22}{'side':<10}{'CPU ms/step':>12}{'hf_dist/other (range)':>24}")
    for pair, s in results.items():
        base = PAIRS[pair]["sides"][0]
        for side in (base, "hf_dist"):
            ratio = f"{s['cpu_ratio']:.2f} ({s['cpu_lo']:.2f}-{s['cpu_hi']:.2f})" if side == "hf_dist" else ""
            lines.append(f"{LABELS[pair] if side == base else '':<22}{side:<10}{s[side]['cpu_ms']:>12.1f}{ratio:>24}")
    lines.append("CPU ms/step: process_time per step summed over the ranks (median): the work each side does; time "
                 "a rank waits for its peer is not in it (gloo waits asleep), so another job's noise moves it less")
    return lines


def ledger_table(first_round: dict[str, dict[str, dict]]) -> list[str]:
    """Rank 0's counted step (the last warm-up step) side by side: per collective, count and MiB of the calls of
    1 KiB or more, and the small calls' count; then the executed FLOPs."""
    lines = [f"{'work':<22}{'collective':<24}{'count other / hf_dist':>24}{'MiB other / hf_dist':>22}"
             f"{'small other / hf_dist':>23}"]
    for pair, sides in first_round.items():
        base = PAIRS[pair]["sides"][0]
        if "ledger" not in sides[base]:
            continue
        a, b = sides[base]["ledger"], sides["hf_dist"]["ledger"]
        label = LABELS[pair]
        for key in sorted(set(a["comms"]) | set(b["comms"])):
            ca, cb = a["comms"].get(key, (0, 0, 0)), b["comms"].get(key, (0, 0, 0))
            lines.append(f"{label:<22}{' '.join(key):<24}{f'{ca[0]} / {cb[0]}':>24}"
                         f"{f'{ca[1] / 2**20:.2f} / {cb[1] / 2**20:.2f}':>22}{f'{ca[2]} / {cb[2]}':>23}")
            label = ""
        flops = f"{a['flops'] / 1e9:.3f} / {b['flops'] / 1e9:.3f}"
        lines.append(f"{label:<22}{'FLOPs (GFLOP)':<24}{flops:>24}")
    lines.append("the ledger: rank 0's last warm-up step (hf_dist.metrics.ledger.attach_ledger), round 1, every "
                 "process group together (all are both ranks here); small: calls under 1 KiB")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run (after 2 warm-up steps)")
    parser.add_argument("--router-aux-loss-coef", type=float, default=MOE["router_aux_loss_coef"],
                        help="the MoE's router aux loss weight (0: the losses then compare the language-model part)")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {','.join(PAIRS)}")
    parser.add_argument("--ledger", action="store_true",
                        help="also count each side's collectives and FLOPs in one warm-up step (round 1) and print "
                             "them side by side: what one side does that the other does not")
    opts = parser.parse_args(argv)
    pairs = [p for p in opts.pairs.split(",") if p]
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown:
        parser.error(f"unknown pair(s) {unknown}; choose from {', '.join(PAIRS)}")
    per_pair: dict[str, list] = {p: [] for p in pairs}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hf_dist_native_") as folder:
        dirs = write_models(folder, opts.router_aux_loss_coef,
                            tuple(dict.fromkeys(PAIRS[p]["model"] for p in pairs)))
        for i in range(opts.rounds):
            for pair in pairs:
                sides = PAIRS[pair]["sides"]
                per_pair[pair].append(run_pair(pair, dirs, opts.steps, sides if i % 2 == 0 else sides[::-1],
                                               ledger=opts.ledger and i == 0))
                print(f"round {i + 1} {pair} done", flush=True)
    results = {p: summarise(r, PAIRS[p]["sides"][0]) for p, r in per_pair.items()}
    print(f"\n{datetime.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after; tiny Llama {LLAMA}, Qwen3-MoE "
          f"{MOE['num_experts']} experts top-{MOE['num_experts_per_tok']}; micro {MICRO} x {SEQ} tokens per rank, "
          f"{opts.steps} measured steps per run")
    for line in table(results, opts.rounds):
        print(line)
    if opts.ledger:
        print()
        for line in ledger_table({p: r[0] for p, r in per_pair.items()}):
            print(line)


if __name__ == "__main__":
    main()

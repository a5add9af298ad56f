"""Long context: peak memory per rank and tokens/s against sequence length, at cp = 1 and cp = 2, on 2 ranks.

Each ``cp`` runs in one ``torchrun --nproc_per_node 2`` launch of this file (``--worker``) that trains a tiny Llama
(sdpa, fp32) through ``hf_dist.parallelize`` for a few forward/backward/AdamW steps per sequence length, lengths in
increasing order. cp = 1 is plain data parallelism (each rank a whole sequence); cp = 2 splits each sequence over
the two ranks (``hf_dist.context_parallel``). Tokens/s counts the tokens the two ranks train together per second.

Peak memory per rank on CPU is the growth of the process's peak RSS (``ru_maxrss``) over its RSS before the first
step: lengths run in increasing order, so each length's peak is the process's peak so far. On a GPU (when one is
present) it is ``torch.cuda.max_memory_allocated``.

    python bench/long_context.py                  # the table, 1k-16k tokens
    python bench/long_context.py --lengths 1024 4096

Not a test: a table of measurements on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HIDDEN, LAYERS, HEADS, VOCAB = 256, 4, 8, 2048


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    from hf_dist.planner.measure import peak_rss_bytes

    return peak_rss_bytes()  # VmHWM: ru_maxrss would carry the parent's peak across exec


def worker(cp: int, lengths: list[int], steps: int) -> None:
    import torch
    import torch.distributed as dist

    from hf_dist import parallelize
    from hf_dist.context_parallel import context_parallel_state, token_weighted_loss
    from hf_dist.models import build_tiny_model
    from hf_dist.strategy import Layout

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    dims = Layout(strategy="ddp", num_gpus=dist.get_world_size(), cp=cp).dims
    dims.build_mesh(device.type)
    model = build_tiny_model(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             num_key_value_heads=HEADS, max_position_embeddings=max(lengths)).to(device)
    model = parallelize(model, dims)
    state = context_parallel_state(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    baseline = _rss_bytes()
    rows = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (1, length), device=device)
        batch = {"input_ids": ids, "labels": ids}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps + 1):  # the first step warms up
            start = time.perf_counter()
            if state is not None:
                with state.split():
                    loss = token_weighted_loss(model, batch, state, reduce_group=dims.get_mesh("dp_cp").get_group(),
                                               reduce_size=dims.dp_cp)
                    loss.backward()
            else:
                model(**batch, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes() - baseline
        tokens = length * dims.dp  # per step, both ranks together
        rows.append({"seq_len": length, "cp": cp, "peak_mib": peak / 2**20,
                     "tokens_per_s": tokens * steps / sum(times[1:])})
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, [r["peak_mib"] for r in rows])
    if dist.get_rank() == 0:
        for i, row in enumerate(rows):
            row["peak_mib"] = max(p[i] for p in peaks)  # the larger rank's
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run(cp: int, lengths: list[int], steps: int) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, "--worker",
               "--cp", str(cp), "--steps", str(steps), "--lengths", *map(str, lengths)]
    out = subprocess.run(command, capture_output=True, text=True, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"cp={cp} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cp", type=int, default=None)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args(argv)
    lengths = sorted(args.lengths)
    if args.worker:
        return worker(args.cp, lengths, args.steps)
    results = {cp: run(cp, lengths, args.steps) for cp in (1, 2)}
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86_64'}, {os.cpu_count()} cores)"
    print(f"tiny Llama (hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, vocab {VOCAB}), fp32, sdpa, 2 ranks, "
          f"{device}, torch {torch.__version__}, {datetime.date.today().isoformat()}")
    print("peak memory per rank: " + ("max_memory_allocated" if torch.cuda.is_available() else
                                      "growth of peak RSS over the RSS before the first step"))
    print(f"| seq len | cp=1 peak MiB/rank | cp=2 peak MiB/rank | cp=1 tokens/s | cp=2 tokens/s |")
    print("|---|---|---|---|---|")
    for one, two in zip(results[1], results[2]):
        print(f"| {one['seq_len']:,} | {one['peak_mib']:.0f} | {two['peak_mib']:.0f} | {one['tokens_per_s']:,.0f} | "
              f"{two['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()

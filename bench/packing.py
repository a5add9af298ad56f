"""Useful (non-pad) tokens per second: packed sequences vs padded batches, on the synthetic transcripts.

Trains the tiny Llama (forward + backward + AdamW step) on batches of ``--batch`` rows of ``--seq`` tokens
built three ways from the same tokenized conversations:

* ``padded to seq``: one conversation per row, padded to the context length (what the case study did);
* ``padded to longest``: one conversation per row, padded to the longest row of the batch (dynamic padding);
* ``packed``: several conversations per row (``hf_dist.data.pack_dataset``), no attention across them.

The modes are timed in interleaved rounds so that load from other processes hits all of them alike.
Prints the machine, the date, the length distribution and a table; the last column is the ratio to
``padded to seq`` (issue target: packed >= 2x).

    .venv/bin/python bench/packing.py [--n 512 --seq 256 --batch 8 --rounds 6 --steps 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=512, help="synthetic conversations")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row (the context length)")
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode per round")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_batches(args, workdir: str):
    """The three modes' batches, cycled from the same conversations, and the length distribution."""
    from hf_dist.data import build_datasets, data_collator, pack_dataset, prepare_demo_data

    jsonl, tok = prepare_demo_data(workdir, n=args.n, seed=args.seed, vocab_size=1024)
    rows, _ = build_datasets(jsonl, tok, max_seq_len=args.seq, loss_on="assistant", eval_fraction=0.0, seed=args.seed)
    packed = pack_dataset(rows, max_seq_len=args.seq)

    def chunks(dataset, collator):
        return [
            collator([dataset[j] for j in range(i, i + args.batch)])
            for i in range(0, len(dataset) - args.batch + 1, args.batch)
        ]

    modes = {
        "padded to seq": chunks(rows, data_collator(tok, pad_to=args.seq)),
        "padded to longest": chunks(rows, data_collator(tok)),
        "packed": chunks(packed, data_collator(tok, packed=True, pad_to=args.seq)),
    }
    lengths = sorted(len(ids) for ids in rows["input_ids"])
    return modes, lengths, tok, len(packed)


def useful_tokens(batch, pad_token_id: int) -> int:
    """Real tokens of a batch: the attention mask when there is one, else the non-pad positions."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int((batch["input_ids"] != pad_token_id).sum())


def time_modes(args, modes, pad_token_id: int) -> dict[str, dict[str, float]]:
    import torch

    from hf_dist.data import PackedCollator, check_model_for_packing
    from hf_dist.models import build_tiny_model

    model = build_tiny_model(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers, seed=args.seed)
    model.config.use_cache = False  # packed rows need it; the Trainer sets it the same way
    check_model_for_packing(model, PackedCollator(pad_token_id=pad_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    stats = {name: {"time": 0.0, "useful": 0, "tokens": 0, "steps": 0, "step_times": []} for name in modes}
    cursor = {name: 0 for name in modes}
    for name, batches in modes.items():  # warm-up: one step per mode, untimed
        step(batches[0])
    for _ in range(args.rounds):
        for name, batches in modes.items():
            for _ in range(args.steps):
                batch = batches[cursor[name] % len(batches)]
                cursor[name] += 1
                start = time.perf_counter()
                step(batch)
                elapsed = time.perf_counter() - start
                entry = stats[name]
                entry["time"] += elapsed
                entry["step_times"].append(elapsed)
                entry["useful"] += useful_tokens(batch, pad_token_id)
                entry["tokens"] += batch["input_ids"].numel()
                entry["steps"] += 1
    return stats


def print_report(args, stats, lengths, n_packed_rows: int) -> None:
    import torch
    import transformers

    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    print(f"date      {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"machine   {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"torch_threads={torch.get_num_threads()} gpu={torch.cuda.is_available()} "
          f"load_avg={os.getloadavg()[0]:.2f}")
    print(f"software  torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model     tiny Llama hidden={args.hidden} layers={args.layers} vocab=1024, AdamW, fp32, sdpa")
    print(f"data      {len(lengths)} conversations, tokens p10/p50/p90/max = {q(0.1)}/{q(0.5)}/{q(0.9)}/"
          f"{lengths[-1]} (truncated at {args.seq}); packed into {n_packed_rows} rows of {args.seq}")
    print(f"batches   {args.batch} rows/step, {args.rounds} rounds x {args.steps} steps per mode, interleaved\n")
    header = f"{'mode':<18} {'tokens/step':>11} {'useful/step':>11} {'fill':>6} {'median step ms':>14} " \
             f"{'useful tok/s':>12} {'vs padded':>9}"
    print(header)
    print("-" * len(header))
    base = stats["padded to seq"]["useful"] / stats["padded to seq"]["time"]
    for name, s in stats.items():
        rate = s["useful"] / s["time"]
        print(f"{name:<18} {s['tokens'] / s['steps']:>11.0f} {s['useful'] / s['steps']:>11.0f} "
              f"{s['useful'] / s['tokens']:>6.2f} {1000 * statistics.median(s['step_times']):>14.1f} "
              f"{rate:>12.0f} {rate / base:>8.2f}x")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        modes, lengths, tok, n_packed_rows = make_batches(args, workdir)
        stats = time_modes(args, modes, tok.pad_token_id)
    print_report(args, stats, lengths, n_packed_rows)


if __name__ == "__main__":
    main()

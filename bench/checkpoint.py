"""Checkpoint save/load time and peak memory on 2 ranks: hf_dist (DCP, sharded) vs torch.save vs accelerate.

    .venv/bin/python bench/checkpoint.py                 # ~100M-parameter Llama, 2 gloo ranks, CPU
    .venv/bin/python bench/checkpoint.py --layers 2      # quicker

Methods (model + AdamW state, after one training step so the optimizer state exists):
- ``hf_dist sync``: ``save_checkpoint`` / ``load_checkpoint`` of an FSDP2 model; each rank writes its shards
  (mean of ``--sync-saves`` saves).
- ``torch.save rank0``: full state dict gathered to rank 0 (``full_state_dict=True, cpu_offload=True``),
  ``torch.save`` there; load = every rank ``torch.load(mmap=True)`` of the full file + ``set_state_dict``.
- ``accelerate save_state``: a DDP model/optimizer prepared by ``Accelerator`` (MULTI_CPU; accelerate cannot
  FSDP on CPU), ``save_state`` / ``load_state``.
- async saves (second table): ``--async-saves`` saves through one ``AsyncCheckpointer`` per staging mode, each
  followed by a training step while it is written. "blocking" = the ``save_checkpoint`` call plus, with
  staging in the writer thread, the wait for the copy before the next ``optimizer.step`` (measured after that
  step's forward/backward): the time the training loop could not go on. "until commit": from the call until
  ``latest`` names the checkpoint (with the step running meanwhile). The first save allocates the staging
  buffers; later ones only copy into them.
Peak memory is the largest resident-set growth of any rank above its level before the operation (sampled
every 5 ms). Ratios are method / hf_dist sync. Timings on a shared 2-core CPU machine are noisy: the sync save
alone took 1.56-3.42 s across runs of the same day.

Measured 2026-11-23, 2-core CPU VM, no GPU, shared with other jobs (load average ~7) (100.7M parameters)::

    method                    save s      x  save peak MiB        x  load s      x  load peak MiB        x
    hf_dist sync                1.56   1.00              7     1.00    0.65   1.00             51     1.00
    torch.save rank0            4.00   2.57             48     6.50    0.80   1.23           1152    22.42
    accelerate save_state       0.65   0.41              0     0.00    0.61   0.93            372     7.24

    async saves through one AsyncCheckpointer (staging in the caller / in the writer thread); sync save (mean
    of 2) 1.56 s; a training step alone 2.06 s
    staging buffers: 576 MiB per rank, allocated at the first save
    save                             blocking s  % of sync  until commit s  step during write s
    caller staging #1 (first)              0.12         8%            2.65                 3.52
    caller staging #2 (cached)             0.10         6%            3.93                 4.15
    caller staging #3 (cached)             0.20        13%            4.80                 5.32
    caller staging #4 (cached)             0.20        13%            8.71                 8.61
    background staging #1 (first)          0.06         4%            9.33                 9.26
    background staging #2 (cached)         0.04         2%            3.80                 6.60
    background staging #3 (cached)         0.02         1%            2.88                 4.85
    background staging #4 (cached)         0.07         4%            3.56                 5.34
    caller staging: blocking 8% of sync at the first save, 13% cached (median of 3); target <= 10%
    background staging: blocking 4% of sync at the first save, 2% cached (median of 3); target <= 10%

An earlier run the same day (3 async saves per mode, sync 3.42 s): caller staging 6% first / 12-15% cached,
background staging 4% first / 1-3% cached. A later one at load average ~4 (``--only-hf-dist``, sync 1.67 s):
caller staging 9% first / 6% cached, background staging 1% first / 1-2% cached. Before ``AsyncCheckpointer`` (``dcp.async_save`` with a fresh
staging copy and the commit in the caller) a quiet run blocked 2.20 s of a 2.75 s sync save (80%).
On the same machine with nothing else running (2026-11-23, load average < 2, sync 2.14 s, a step alone 2.63 s):
caller staging 9% first / 5% cached (0.19 s, then 0.09-0.10 s), background staging 1% first / 1% cached
(0.01-0.02 s); commits 1.8-4.9 s after the call.

Read: hf_dist writes each rank's shards from where they live (almost no extra memory; the save includes
fsync of every file); torch.save gathers the full state to rank 0 first. accelerate runs DDP here (every rank
already holds the full model and optimizer, and rank 0 writes it without gathering), so its save is fast but
its layout holds 2x the memory per rank to begin with and it cannot resume into another layout. Async saves
with staging in the writer thread (what ``DistTrainer --async_save`` uses) block 1-4% of a sync save, first
save included: the copy overlaps the next forward/backward. Staging in the caller blocks for a memcpy of the
rank's 576 MiB (0.1-0.5 s here depending on load): under the 10% target at load ~4, over it at load ~7.
The write itself shares the 2 cores with training: the step run during a write is slower than a step alone,
and the commit comes seconds later. The hf_dist rows run with ``hash_files=False``; the default (SHA-256 of
every file, each rank its own, in the writer thread for async saves) hashed at ~400 MB/s per rank on this
machine, about 1.5 s more for the ~600 MB each rank writes here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class PeakRss:
    """Largest RSS growth of this process while the block runs."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.start = self._proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.growth = self.peak - self.start


def _model(args):
    from hf_dist.models import build_tiny_model

    return build_tiny_model(
        seed=0, vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=12, num_key_value_heads=4, intermediate_size=args.intermediate,
    )


def _one_step(model, optimizer):
    ids = torch.randint(0, model.config.vocab_size if hasattr(model, "config") else 100, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _fsdp(args, world):
    from torch.distributed.fsdp import fully_shard

    from hf_dist import ParallelDims

    layout = ParallelDims(world_size=world, dp_shard=world)
    mesh = layout.build_mesh("cpu")["dp_shard"]
    model = _model(args)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _one_step(model, optimizer)
    return model, optimizer, layout


def _measure(fn) -> tuple[float, int]:
    dist.barrier()
    with PeakRss() as peak:
        fn()
        dist.barrier()
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, (peak.seconds, peak.growth))
    return max(s[0] for s in stats), max(s[1] for s in stats)


def _max_over_ranks(value: float) -> float:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return max(values)


def _timed_step(model, optimizer) -> float:
    t0 = time.perf_counter()
    _one_step(model, optimizer)
    return _max_over_ranks(time.perf_counter() - t0)


def _async_saves(save, model, optimizer, root, n_saves: int, background: bool) -> list[dict]:
    """``n_saves`` saves through one ``AsyncCheckpointer``, each followed by a training step during its write.

    Blocking = the save call, plus (``stage_in_background``) the wait for the copy before the next
    ``optimizer.step``: the time the training loop could not go on.
    """
    from hf_dist.checkpoint import AsyncCheckpointer

    out = []
    with AsyncCheckpointer(stage_in_background=background) as saver:
        for i in range(n_saves):
            dist.barrier()
            committed = []
            t0 = time.perf_counter()
            handle = save(f"{root}/dcp_async_{int(background)}_{i}", async_save=saver)
            blocking = time.perf_counter() - t0
            handle.add_done_callback(lambda: committed.append(time.perf_counter()))
            step = time.perf_counter()
            ids = torch.randint(0, model.config.vocab_size, (1, 16))
            model(input_ids=ids, labels=ids).loss.backward()  # training goes on while the shards are written
            wait = time.perf_counter()
            handle.wait_staged()  # what optimizer.step would wait for (its pre-hook)
            blocking += time.perf_counter() - wait
            optimizer.step()
            optimizer.zero_grad()
            step = time.perf_counter() - step
            handle.result()
            stats = [None] * dist.get_world_size()
            dist.all_gather_object(stats, (blocking, committed[0] - t0, step))
            out.append({key: max(s[j] for s in stats) for j, key in enumerate(("blocking", "commit", "step"))})
    return out


def _state_bytes(model, optimizer) -> int:
    """Bytes of this rank's parameters and optimizer state: what an async save copies."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _hf_dist(args, root, rows):
    from hf_dist.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer, layout = _fsdp(args, dist.get_world_size())
    save = lambda path, **kw: save_checkpoint(path, model=model, optimizer=optimizer, step=1, samples_consumed=1,
                                              layout=layout, batch_contract=None, hash_files=False, **kw)
    syncs = [_measure(lambda i=i: save(f"{root}/dcp_sync_{i}")) for i in range(args.sync_saves)]
    rows["hf_dist sync"] = {"save": (sum(s[0] for s in syncs) / len(syncs), max(s[1] for s in syncs)),
                            "sync_all": [s[0] for s in syncs]}
    rows["hf_dist sync"]["load"] = _measure(lambda: load_checkpoint(f"{root}/dcp_sync_0", model=model,
                                                                    optimizer=optimizer))
    rows["step alone"] = _timed_step(model, optimizer)
    saves = {mode: _async_saves(save, model, optimizer, root, args.async_saves, background=mode == "background")
             for mode in ("caller", "background")}
    rows["hf_dist async"] = {"saves": saves, "staged": _max_over_ranks(_state_bytes(model, optimizer))}
    del model, optimizer


def _torch_save(args, root, rows):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model, optimizer, _ = _fsdp(args, dist.get_world_size())
    path = f"{root}/full.pt"

    def save():
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save({"model": msd, "optim": osd}, path)

    def load():
        full = torch.load(path, weights_only=True, mmap=True)  # every rank reads the whole file
        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"], options=options)

    rows["torch.save rank0"] = {"save": _measure(save), "load": _measure(load)}
    del model, optimizer


def _accelerate(args, root, rows):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    _one_step(model, optimizer)
    kind = f"{accelerator.distributed_type.value}x{accelerator.num_processes}"
    if accelerator.num_processes != dist.get_world_size():
        raise RuntimeError(f"accelerate runs {kind}, not {dist.get_world_size()} processes: not comparable")
    rows["accelerate save_state"] = {
        "save": _measure(lambda: accelerator.save_state(f"{root}/accel")),
        "load": _measure(lambda: accelerator.load_state(f"{root}/accel")),
    }


def _worker(rank, world, port, args, root, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(args.stall_s, exit=True, file=sys.stderr)  # a hung collective: show where
    rows: dict = {}
    for stage in (_hf_dist,) if args.only_hf_dist else (_hf_dist, _torch_save, _accelerate):
        stage(args, root, rows)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: dict, n_params: int, args) -> str:
    base = rows["hf_dist sync"]
    lines = [
        f"checkpoint bench: {n_params / 1e6:.1f}M-parameter Llama + AdamW, 2 gloo ranks, CPU "
        f"(hidden {args.hidden}, {args.layers} layers, vocab {args.vocab})",
        f"{'method':<24}{'save s':>8}{'x':>7}{'save peak MiB':>15}{'x':>9}{'load s':>8}{'x':>7}{'load peak MiB':>15}{'x':>9}",
    ]
    for name, row in rows.items():
        if name in ("step alone", "hf_dist async"):  # their own table below
            continue
        cells = []
        for op in ("save", "load"):
            if op not in row:
                cells += ["-", "", "-", ""]
                continue
            seconds, growth = row[op]
            b_seconds, b_growth = base[op]
            cells += [f"{seconds:.2f}", f"{seconds / b_seconds:.2f}", f"{growth / 2**20:.0f}",
                      f"{growth / max(b_growth, 1):.2f}"]
        lines.append(f"{name:<24}{cells[0]:>8}{cells[1]:>7}{cells[2]:>15}{cells[3]:>9}"
                     f"{cells[4]:>8}{cells[5]:>7}{cells[6]:>15}{cells[7]:>9}")
    lines += _async_table(rows)
    return "\n".join(lines)


def _async_table(rows: dict) -> list[str]:
    sync = rows["hf_dist sync"]["save"][0]
    lines = [
        "",
        f"async saves through one AsyncCheckpointer (staging in the caller / in the writer thread); sync save (mean "
        f"of {len(rows['hf_dist sync']['sync_all'])}) {sync:.2f} s; a training step alone {rows['step alone']:.2f} s",
        f"staging buffers: {rows['hf_dist async']['staged'] / 2**20:.0f} MiB per rank, allocated at the first save",
        f"{'save':<32}{'blocking s':>11}{'% of sync':>11}{'until commit s':>16}{'step during write s':>21}",
    ]
    for mode, saves in rows["hf_dist async"]["saves"].items():
        for i, save in enumerate(saves):
            name = f"{mode} staging #{i + 1} ({'first' if i == 0 else 'cached'})"
            lines.append(f"{name:<32}{save['blocking']:>11.2f}{100 * save['blocking'] / sync:>10.0f}%"
                         f"{save['commit']:>16.2f}{save['step']:>21.2f}")
    for mode, saves in rows["hf_dist async"]["saves"].items():
        cached = sorted(save["blocking"] for save in saves[1:])
        median = cached[len(cached) // 2] if cached else float("nan")
        lines.append(f"{mode} staging: blocking {100 * saves[0]['blocking'] / sync:.0f}% of sync at the first save, "
                     f"{100 * median / sync:.0f}% cached (median of {len(cached)}); target <= 10%")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--sync-saves", type=int, default=2, help="synchronous saves averaged")
    parser.add_argument("--async-saves", type=int, default=4, help="asynchronous saves (the first allocates)")
    parser.add_argument("--only-hf-dist", action="store_true", help="skip the torch.save and accelerate rows")
    parser.add_argument("--stall-s", type=float, default=1800, help="dump stacks and exit if a rank runs this long")
    args = parser.parse_args()
    n_params = sum(p.numel() for p in _model(args).parameters())
    root = tempfile.mkdtemp(prefix="hf_dist_ckpt_bench_")
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        from socket import socket

        with socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [ctx.Process(target=_worker, args=(r, 2, port, args, root, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode != 0 for proc in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        print(_table(queue.get(), n_params, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

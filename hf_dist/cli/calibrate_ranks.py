"""``hf-dist plan --calibrate`` across real processes: the chosen layout's parallelism on the ranks at hand.

``calibrate_for_plan`` picks the path. With more than one rank available (GPUs on this node, or on a CPU two gloo
ranks when it has two cores; ``--calibrate-ranks`` sets it), ``calibrate_on_ranks`` scales the chosen layout to
those ranks (``hf_dist.planner.calibrate.calibration_layout``), starts one process per rank (gloo on CPU, NCCL
with one GPU each), builds the scaled-down model on each, lays it out with the package's own apply path
(``hf_dist.parallelize``: TP, activation checkpointing, FSDP2, as DistTrainer runs them; DDP is
torch's ``DistributedDataParallel``, which accelerate wraps for DistTrainer), times a few training steps with
the real collectives, and derives the efficiency: executed FLOPs of every data-parallel rank's tokens over the
slowest rank's mean step time times the sum of the ranks' peaks. That efficiency includes the scaled-down run's
own collectives on this machine's links; the forecast adds the whole layout's communication time (its bytes over
the given bandwidths) on top, so the step it gives is conservative by about those collectives. With one rank (one GPU, a one-core CPU, a
one-GPU layout, or ``--calibrate-ranks 1``) the one-device path of ``hf_dist.planner.calibrate.calibrate`` runs,
and its source line says so and why. A failed multi-rank run is an error naming that flag, never a silent switch.

Under cli/ because the apply path lives in ``hf_dist.trainer``, which imports the planner.

Not here: the efficiency arithmetic, the scaled-down model or the one-device path (``hf_dist.planner.calibrate``).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from hf_dist.planner.calibrate import (Calibration, calibrate, calibration_layout, compute_dtypes,
                                       device_peak_flops, efficiency_from, scaled_model, timed_steps)
from hf_dist.planner.catalogue import ModelSpec
from hf_dist.planner.workload import Workload
from hf_dist.strategy import FSDP_STRATEGIES, Layout


@dataclass(frozen=True)
class _Job:
    """What every rank runs (pickled to the spawned processes): each layout in turn, in one process group."""

    model: ModelSpec
    workload: Workload
    layouts: tuple[Layout, ...]
    layers: int
    steps: int
    device_type: str


def default_ranks(layout: Layout) -> int:
    """Ranks to calibrate on: this node's GPUs, or on a CPU two gloo ranks when it has two cores; never more than
    the layout's ranks per node."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else min(2, os.cpu_count() or 1)
    return max(1, min(available, layout.num_gpus))


def calibrate_for_plan(model: ModelSpec, workload: Workload, layout: Layout, *, ranks: int | None = None,
                       layers: int = 2, steps: int = 3) -> Calibration:
    """The chosen ``layout`` measured on ``ranks`` processes (default ``default_ranks``), or on one device."""
    why_one = "one rank available" if ranks is None else "--calibrate-ranks 1"
    ranks = default_ranks(layout) if ranks is None else ranks
    if ranks < 1:
        raise ValueError(f"--calibrate-ranks={ranks} must be positive")
    if torch.cuda.is_available() and ranks > torch.cuda.device_count():
        raise ValueError(f"--calibrate-ranks={ranks} but this node has {torch.cuda.device_count()} GPUs; "
                         f"use at most that")
    if ranks == 1:
        return calibrate(model, workload, layers=layers, steps=steps,
                         note=f"; {why_one}" if layout.dims.world_size > 1 else "")
    try:
        return calibrate_on_ranks(model, workload, layout, ranks=ranks, layers=layers, steps=steps)
    except (ProcessException, OSError) as err:  # no silent switch to the other path
        lines = str(err).strip().splitlines()
        reason = lines[-1] if lines else type(err).__name__
        raise RuntimeError(f"the {ranks}-rank calibration failed ({reason}); fix that, or pass --calibrate-ranks 1 "
                           f"to measure one device's compute only") from err


def calibrate_on_ranks(model: ModelSpec, workload: Workload, layout: Layout, *, ranks: int, layers: int = 2,
                       steps: int = 3) -> Calibration:
    """Run ``layout`` scaled to ``ranks`` processes with its real collectives and measure the efficiency."""
    return calibrate_layouts_on_ranks(model, workload, [layout], ranks=ranks, layers=layers, steps=steps)[0]


def calibrate_layouts_on_ranks(model: ModelSpec, workload: Workload, layouts: list[Layout], *, ranks: int,
                               layers: int = 2, steps: int = 3) -> list[Calibration]:
    """``calibrate_on_ranks`` for several layouts, one after the other in one set of processes."""
    if layers < 1 or steps < 1:
        raise ValueError(f"layers={layers} and steps={steps} must be positive")
    runs = tuple(calibration_layout(layout, ranks) for layout in layouts)
    layers = min(layers, model.num_hidden_layers)
    job = _Job(model=model, workload=workload, layouts=runs, layers=layers, steps=steps,
               device_type="cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="hf_dist_calibrate_") as tmp:
        out = Path(tmp) / "rank0.json"
        torch.multiprocessing.start_processes(_rank_main, args=(ranks, _free_port(), job, str(out)), nprocs=ranks,
                                              join=True, start_method="spawn")
        measured = json.loads(out.read_text())
    return [_calibration(model, workload, layout, run, m, job) for layout, run, m in zip(layouts, runs, measured)]


def _calibration(model: ModelSpec, workload: Workload, layout: Layout, run: Layout, measured: dict,
                 job: _Job) -> Calibration:
    ranks = run.dims.world_size
    eff = efficiency_from(model, workload, layers=job.layers, tokens=workload.tokens * run.dims.dp,
                          step_time_s=measured["step_time_s"], peak_flops=measured["peak_flops"])
    backend = "NCCL" if job.device_type == "cuda" else "gloo"
    what = _describe(run)
    if run.strategy != layout.strategy:
        what += f" (standing in for {layout.strategy}: same collectives)"
    source = (f"calibrated on {ranks} {backend} ranks with real collectives: {what}, {job.steps} steps of a "
              f"{job.layers}-layer {model.name} on {job.device_type} ({measured['peak_flops'] / 1e12:.2f} TFLOP/s "
              f"peak over the ranks, {measured['peak_source']}), micro batch {workload.micro_batch_size} x "
              f"{workload.seq_len} tokens per dp rank")
    return Calibration(efficiency=eff, step_time_s=measured["step_time_s"], peak_flops=measured["peak_flops"],
                       source=source, ranks=ranks, measured_tp=run.tp,
                       local_parameters=measured["local_parameters"])


def _describe(run: Layout) -> str:
    names = {"ddp": "DDP", "fsdp_full_shard": "FSDP2 FULL_SHARD", "fsdp_shard_grad_op": "FSDP2 SHARD_GRAD_OP"}
    text = f"{names[run.strategy]} over dp={run.dims.dp}"
    if run.tp > 1:
        options = [n for n, on in (("sequence", run.sequence_parallel), ("vocab", run.vocab_parallel)) if on]
        text += f" x TP{run.tp}" + (f" ({' + '.join(options)} parallel)" if options else "")
    return text


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, ranks: int, port: int, job: _Job, out: str) -> None:
    """One rank: join the group, measure, and (rank 0) write the result for the parent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks))
    cuda = job.device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ranks)
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        result = [_measure(device, ranks, job, run) for run in job.layouts]
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(device: torch.device, ranks: int, job: _Job, run: Layout) -> dict:
    """Build, lay out and time the scaled-down model on this rank; the slowest step and the summed peak."""
    workload = job.workload
    fsdp = run.strategy in FSDP_STRATEGIES
    dtype, param_dtype, autocast = compute_dtypes(workload, device, fsdp=fsdp)
    torch.manual_seed(0)  # the same weights and batch on every rank
    net = scaled_model(job.model, job.layers, dtype, device)
    dims = run.dims  # the Layout of these ranks (planner.calibrate builds it for this world size)
    dims.build_mesh(device.type)
    net = _apply(net, dims, run, activation_checkpointing=workload.activation_checkpointing,
                 param_dtype=param_dtype)
    ids = torch.randint(0, job.model.vocab_size, (workload.micro_batch_size, workload.seq_len)).to(device)
    local = sum(getattr(p, "_local_tensor", p).numel() for p in net.parameters())  # shards under FSDP2/TP
    times = timed_steps(net, ids, steps=job.steps, autocast=autocast)
    dist.barrier()  # every rank measures its peak at once, as it trained: sharing the cores
    peak, peak_source = device_peak_flops(device, dtype)
    step = torch.tensor([sum(times) / len(times)], dtype=torch.float64, device=device)
    total_peak = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    dist.all_reduce(total_peak, op=dist.ReduceOp.SUM)
    return {"step_time_s": step.item(), "peak_flops": total_peak.item(), "peak_source": peak_source,
            "local_parameters": local}


def _apply(net: torch.nn.Module, dims, run: Layout, *, activation_checkpointing: bool,
           param_dtype: torch.dtype | None) -> torch.nn.Module:
    """Lay ``net`` out as DistTrainer would: the package's apply path, and torch DDP where accelerate wraps it."""
    from hf_dist.parallelism import FsdpRequest, parallelize

    fsdp = FsdpRequest(reshard_after_forward=run.strategy != "fsdp_shard_grad_op", source="hf-dist plan --calibrate") \
        if run.strategy in FSDP_STRATEGIES else None
    ddp = fsdp is None and not dims.tp_enabled and dims.dp > 1  # accelerate's DDP, as DistTrainer leaves it
    net = parallelize(net, dims, fsdp=fsdp, activation_checkpointing=activation_checkpointing,
                      param_dtype=param_dtype, sequence_parallel=run.sequence_parallel,
                      vocab_parallel=run.vocab_parallel, replicate_gradients=not ddp)
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(net)
    return net


__all__ = ["calibrate_for_plan", "calibrate_layouts_on_ranks", "calibrate_on_ranks", "default_ranks"]

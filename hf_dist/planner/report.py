"""Present a ``Plan``: the ranked table with breakdowns, the same as JSON, and a stacked bar chart.

Not here: choosing (``chooser.py``) or writing configs (``hf_dist.configs``, called by ``hf-dist plan --out``).
"""

from __future__ import annotations

from hf_dist.planner.chooser import Candidate, Plan
from hf_dist.planner.memory import MemoryBreakdown, format_breakdown, gib


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.0f} s"


def _row(c: Candidate) -> str:
    mark = "*" if c.chosen else ("ok" if c.fits else "x")
    m = c.memory
    mem = f"{gib(m.allocated):6.1f} {gib(m.reserved):6.1f} {gib(m.total):6.1f}" if m else f"{'-':>6} {'-':>6} {'-':>6}"
    host = f"{gib(c.host.peak):6.0f}" if c.host else f"{'-':>6}"
    t = c.throughput
    tps = f"{t.tokens_per_s:9,.0f}" if t else f"{'-':>9}"
    times = f"{t.compute_s:7.2f} {t.communication_s:7.3f} {t.step_time_s:7.2f}" if t else f"{'-':>7} {'-':>7} {'-':>7}"
    warn = f" [warning: {'; '.join(c.warnings)}]" if c.warnings else ""
    return f"{mark:>2} {c.tier:>4}  {c.name:<30} {mem} {host}  {times}  {tps}  {c.reason}{warn}"


def _communication_lines(c: Candidate) -> list[str]:
    """The ledger minimum's rows of ``c``, timed."""
    comm = c.throughput.communication
    if not comm.rows:
        return ["  communication per step: none (one rank per group)"]
    lines = [f"  communication per step and rank (ledger minimum): {comm.seconds:.3f} s (intra-node "
             f"{comm.intra_node_s:.3f}, inter-node {comm.inter_node_s:.3f})"]
    lines += [f"    {r.kind:<14} over {r.axis:<12} {r.ranks:>4} ranks {'inter' if r.inter_node else 'intra'}-node "
              f"{r.bytes / 1e9:9.3f} GB {r.seconds:8.3f} s" for r in comm.rows]
    return lines


def _trainer_line(req) -> str:
    """What ``--trainer dpo|grpo`` adds to each layout."""
    reference = ("a frozen reference model laid out like the policy (its parameters, no gradients or optimizer "
                 "state; under LoRA the adapter-disabled policy, nothing more)" if req.has_reference
                 else "no reference model (beta = 0)")
    if req.trainer == "dpo":
        return (f"trainer dpo: micro batch {req.micro_batch} pairs = {2 * req.micro_batch} sequences per forward "
                f"(chosen + rejected); {reference}")
    return (f"trainer grpo: global batch {req.global_batch} completions = {req.global_batch // req.num_generations} "
            f"prompts x {req.num_generations} generations, generated at once per rank (a KV cache of seq "
            f"{req.seq_len} each; generation time not forecast); {reference}")


def plan_table(plan: Plan, *, breakdowns: bool = True) -> str:
    """The ranked table, the breakdown of every evaluated candidate, and the chosen layout."""
    req = plan.request
    lines = [
        f"hf_dist plan: {req.model.name} ({req.model.num_params / 1e9:.2f}B params) on {req.num_nodes} x "
        f"{req.num_gpus} {req.gpu.name} ({gib(req.gpu.memory_bytes):.1f} GiB, limit "
        f"{gib(req.memory_limit):.1f} GiB with {req.safety_margin:.0%} margin)",
        f"seq {req.seq_len}, global batch {req.global_batch}, micro batch {req.micro_batch}, {req.precision}, "
        f"{req.attention}, activation checkpointing {'on' if req.activation_checkpointing else 'off'}; host RAM "
        f"{gib(req.host_ram):.0f} GiB per node, loading {req.loading}",
        *([_trainer_line(req)] if req.trainer != "sft" else []),
        "GiB per GPU: alloc = max_memory_allocated, resv = max_memory_reserved, in use = resv + CUDA context + NCCL"
        " (nvidia-smi); host = GiB of host RAM per node (loading or offload)",
        f"seconds per optimizer step: compute = executed FLOPs / (peak x efficiency), comm = the ledger minimum's bytes"
        f" over NVLink/PCIe {req.links.intra_node / 1e9:g} GB/s inside a node and {req.links.inter_node / 1e9:g} GB/s"
        f" per GPU between nodes; step = max(compute, data-parallel comm) + TP/PP/EP/CP comm (data-parallel"
        f" collectives overlap compute, the others do not)",
        "",
        f"{'':>2} {'tier':>4}  {'layout':<30} {'alloc':>6} {'resv':>6} {'in use':>6} {'host':>6}  {'compute':>7} "
        f"{'comm':>7} {'step':>7}  {'tokens/s':>9}  reason",
    ]
    lines += [_row(c) for c in plan.candidates]
    if breakdowns:
        for c in plan.candidates:
            if c.memory:
                lines += ["", f"{c.name} ({c.workload_precision}; peak at {c.memory.peak_phase}, stage "
                          f"{c.memory.stage}):", format_breakdown(c.memory)]
                if c.host:
                    lines.append(f"  host RAM per node: loading {gib(c.host.loading):.0f} GiB ({c.host.how_loaded}),"
                                 f" offload {gib(c.host.offload):.0f} GiB (x{req.assumptions.host_buffer_factor} "
                                 f"buffer factor)")
                if c.memory.cpu_offload or c.memory.nvme_offload:
                    lines.append(f"  offloaded per rank: CPU {gib(c.memory.cpu_offload):.2f} GiB, "
                                 f"NVMe {gib(c.memory.nvme_offload):.2f} GiB")
                if c.throughput:
                    lines += _communication_lines(c)
    lines.append("")
    chosen = plan.chosen
    if chosen is None:
        lines.append("chosen: none fits; use more GPUs, a shorter context, --lora, or a smaller model")
    else:
        t = chosen.throughput
        lines.append(f"chosen: {chosen.name}: {gib(chosen.memory.allocated):.1f} GiB allocated, "
                     f"{gib(chosen.memory.reserved):.1f} reserved, {gib(chosen.memory.total):.1f} in use per GPU, "
                     f"{gib(chosen.host.peak):.0f} GiB host RAM per node; "
                     f"{chosen.batch.global_batch_size} = {chosen.batch.micro_batch_size} x {chosen.batch.dp} x "
                     f"{chosen.batch.gradient_accumulation_steps} (micro x dp x accumulation); "
                     f"{t.step_time_s:.2f} s/step (compute {t.compute_s:.2f}, communication "
                     f"{t.communication_s:.3f} of which {t.communication.exposed_s:.3f} not overlapped), "
                     f"{t.tokens_per_s:,.0f} tokens/s at {t.mfu:.0%} MFU "
                     f"(efficiency {t.efficiency:.0%}: {t.efficiency_source})")
        if req.useful_fraction < 1:
            lines.append(f"useful (non-padding) tokens/s: {t.useful_tokens_per_s:,.0f} "
                         f"({req.useful_fraction:.0%} of the tokens carry data)")
        if req.train_tokens:
            wall = _duration(t.wall_clock_s(req.train_tokens))
            lines.append(f"wall clock for {req.train_tokens:,.0f} tokens: {wall}")
    return "\n".join(lines)


def _candidate_dict(c: Candidate, train_tokens: float | None) -> dict:
    d = c.layout.dims
    out = {
        "name": c.name, "tier": c.tier, "strategy": c.layout.strategy, "tp": d.tp, "pp": d.pp,
        "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "offload": c.layout.offload,
        "lora_rank": c.layout.lora_rank, "sequence_parallel": c.layout.sequence_parallel,
        "fits": c.fits, "chosen": c.chosen, "reason": c.reason, "warnings": list(c.warnings),
        "precision": c.workload_precision, "memory": c.memory.as_dict() if c.memory else None,
        "host_ram": {"loading": c.host.loading, "offload": c.host.offload, "peak": c.host.peak,
                     "how_loaded": c.host.how_loaded} if c.host else None,
        "batch": c.batch.as_dict() | {"gradient_accumulation_steps": c.batch.gradient_accumulation_steps}
        if c.batch else None,
    }
    if c.throughput:
        t = c.throughput
        out["throughput"] = {"step_time_s": t.step_time_s, "compute_s": t.compute_s,
                             "communication_s": t.communication_s, "communication": t.communication.as_dict(),
                             "tokens_per_s": t.tokens_per_s, "mfu": t.mfu,
                             "useful_tokens_per_s": t.useful_tokens_per_s,
                             "efficiency": t.efficiency, "efficiency_source": t.efficiency_source,
                             "model_flops_per_token": t.model_flops_per_token,
                             "executed_flops_per_token": t.executed_flops_per_token}
        if train_tokens:
            out["throughput"]["wall_clock_s"] = t.wall_clock_s(train_tokens)
    return out


def plan_json(plan: Plan) -> dict:
    """The plan as JSON-ready data."""
    req = plan.request
    return {
        "model": {"name": req.model.name, "num_params": req.model.num_params},
        "gpu": {"name": req.gpu.name, "memory_bytes": req.gpu.memory_bytes,
                "peak_bf16_flops": req.gpu.peak_bf16_flops, "intra_node_bytes_per_s": req.links.intra_node,
                "inter_node_bytes_per_s": req.links.inter_node},
        "num_gpus": req.num_gpus, "num_nodes": req.num_nodes, "seq_len": req.seq_len,
        "global_batch": req.global_batch, "micro_batch": req.micro_batch, "precision": req.precision,
        "attention": req.attention, "activation_checkpointing": req.activation_checkpointing,
        "safety_margin": req.safety_margin, "memory_limit": req.memory_limit, "host_ram": req.host_ram,
        "loading": req.loading,
        "trainer": req.trainer, "reference_model": req.has_reference,
        "num_generations": req.num_generations if req.trainer == "grpo" else None,
        "candidates": [_candidate_dict(c, req.train_tokens) for c in plan.candidates],
        "chosen": plan.chosen.name if plan.chosen else None,
    }


def plot_plan(plan: Plan, path: str) -> None:
    """A stacked bar per evaluated candidate (GiB per GPU, by term), with the memory limit as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluated = [c for c in plan.candidates if c.memory]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(evaluated) + 3), 6))
    bottoms = [0.0] * len(evaluated)
    colours = plt.get_cmap("tab20").colors
    for i, term in enumerate(MemoryBreakdown.TERMS):
        values = [gib(getattr(c.memory, term)) for c in evaluated]
        if any(values):
            ax.bar(range(len(evaluated)), values, bottom=bottoms, label=term, color=colours[i % len(colours)])
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axhline(gib(plan.request.memory_limit), color="red", linestyle="--", label="limit (with margin)")
    ax.set_xticks(range(len(evaluated)), [("* " if c.chosen else "") + c.name for c in evaluated],
                  rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_ylim(0, min(max(bottoms + [1.0]) * 1.05, 3 * gib(plan.request.gpu.memory_bytes)))
    ax.set_title(f"{plan.request.model.name} on {plan.request.world_size} x {plan.request.gpu.name}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""How many pipeline micro-batches a step runs: gradient accumulation folded into the pipeline (pure).

The batch contract derives accumulation ``a`` from the global batch; with PP one optimizer step is one pipeline
step over the data-parallel rank's whole share of the global batch (``per_device_train_batch_size x a``
sequences) cut into ``a`` micro-batches, so the Trainer runs with ``gradient_accumulation_steps=1`` and a
data-loader batch of ``micro x a`` (``fold_accumulation_into_pipeline``; ``per_device_train_batch_size`` keeps
meaning the micro-batch). ``pp_microbatches`` states ``a`` directly when no global batch is given. A count the
schedule cannot run (``schedules.microbatch_problem``) splits the micro batch when it divides, keeping the
global batch, or stops naming the smallest valid settings.

Not for: running the schedule (``pipeline``) or the Trainer hooks (``hf_dist.trainer``).
"""

from __future__ import annotations

import logging
import os

from hf_dist.pipeline_parallel.schedules import PipelineConfig, microbatch_problem, smallest_valid_microbatches

logger = logging.getLogger(__name__)


def fold_accumulation_into_pipeline(args) -> None:
    """With ``pp_size > 1``: pipeline micro-batches = contract accumulation; Trainer accumulation = 1."""
    if args.layout.pp <= 1:
        return
    m = args.pp_microbatches
    contract = args.batch_contract
    if m is not None and m != contract.gradient_accumulation_steps:
        if args.global_batch_size is None and contract.gradient_accumulation_steps == 1:
            args.gradient_accumulation_steps = m  # no global batch given: pp_microbatches defines it
            args.batch_contract = contract = args._resolve_contract()
        else:
            raise ValueError(
                f"pp_microbatches={m} contradicts the batch contract: global_batch_size={contract.global_batch_size} "
                f"= per_device_train_batch_size={contract.micro_batch_size} x dp={contract.dp} x "
                f"{contract.gradient_accumulation_steps} micro-batches; with pp_size > 1 the micro-batches are the "
                f"accumulation steps, so drop pp_microbatches or set global_batch_size="
                f"{contract.micro_batch_size * contract.dp * m}"
            )
    if microbatch_problem(args.pp_schedule, contract.gradient_accumulation_steps, args.layout.pp) is not None:
        contract = _split_micro_batch(args, explicit=m is not None)
    PipelineConfig(schedule=args.pp_schedule, microbatches=contract.gradient_accumulation_steps)  # validate early
    # Idempotent: re-creating the arguments from these values (to_dict, resume) resolves the same contract.
    # The data loader's batch (micro x micro-batches) is set on the Trainer by hf_dist.trainer.data.use_dp_group.
    args.pp_microbatches = contract.gradient_accumulation_steps
    args.gradient_accumulation_steps = 1


def _split_micro_batch(args, *, explicit: bool):
    """Too few micro-batches for the schedule: split ``per_device_train_batch_size`` into the smallest valid count
    (the global batch unchanged) when it divides, else stop naming the smallest valid settings."""
    contract = args.batch_contract
    a, micro, dp = contract.gradient_accumulation_steps, contract.micro_batch_size, contract.dp
    problem = microbatch_problem(args.pp_schedule, a, args.layout.pp)
    rows = micro * a  # sequences per data-parallel rank and step
    split = next((k for k in range(a + 1, rows + 1) if rows % k == 0
                  and microbatch_problem(args.pp_schedule, k, args.layout.pp) is None), None)
    if split is not None and not explicit:
        args.per_device_train_batch_size = rows // split
        args.gradient_accumulation_steps = split
        args.batch_contract = args._resolve_contract()
        _note_split(args, micro, split)
        return args.batch_contract
    need = smallest_valid_microbatches(args.pp_schedule, args.layout.pp, at_least=a)
    raise ValueError(
        f"{problem}, but this run gives {a} (global_batch_size={contract.global_batch_size} = "
        f"per_device_train_batch_size={micro} x dp={dp} x {a} micro-batches). Set pp_microbatches={need} (or "
        f"gradient_accumulation_steps={need}, or global_batch_size={micro * dp * need}), or a "
        f"per_device_train_batch_size that splits into {need} micro-batches, or another pp_schedule (gpipe takes any)"
    )


def _note_split(args, micro: int, split: int) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning(
            "pp_size=%d: per_device_train_batch_size=%d is run as %d pipeline micro-batches of %d (the global batch "
            "is unchanged); set pp_microbatches or global_batch_size to choose", args.layout.pp, micro, split,
            micro // split)


def microbatches_for_rows(args, rows: int) -> int:
    """Micro-batches for a batch of ``rows`` sequences: the configured count, or for an epoch's short last batch
    fewer of the same size -- or, when that count is one the schedule cannot run, the smallest count it runs
    that splits the rows evenly."""
    micro, configured = args.per_device_train_batch_size, args.pp_microbatches
    if rows == micro * configured or rows % micro != 0:
        return configured  # a full batch, or one train_step refuses with the reason
    count = rows // micro
    if microbatch_problem(args.pp_schedule, count, args.layout.pp) is None:
        return count
    for k in range(count + 1, rows + 1):
        if rows % k == 0 and microbatch_problem(args.pp_schedule, k, args.layout.pp) is None:
            return k
    raise ValueError(
        f"the epoch's last batch has {rows} sequence(s) per data-parallel rank, which pp_schedule="
        f"{args.pp_schedule!r} cannot split over pp_size={args.layout.pp} stages; set dataloader_drop_last=True, or a "
        f"dataset size that fills whole batches of {micro * configured} per data-parallel rank")

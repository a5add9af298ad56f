"""Every private member of transformers, accelerate or torch that hf_dist overrides, patches, sets, calls or reads
-- anywhere in hf_dist, not only in the Trainer glue -- and why.

An override of a method the base class stops calling fails silently (gradient sync or clipping just stops), so
each one is listed here with the reason and the public ``Trainer`` method that calls it. ``check_internals`` runs
when a ``DistTrainer`` is built, in ``hf_dist.from_pretrained`` before any weight and in ``hf_dist.apply_layout``
before any mesh, and stops with the installed versions if one of them is gone (every member whose
owner is an importable path: a class, module or object of the library), and warns once (main process) when
transformers, accelerate, torch, peft or trl is outside the tested range;
``tests/test_trainer_internals.py`` checks that each override is still *called*, in a real run, for the versions
in ``TESTED_VERSIONS`` (the bounds in ``setup.cfg`` and the README).

Not here: the code that touches them (each member's ``where`` names the module).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

TESTED_VERSIONS: dict[str, tuple[str, str]] = {
    "transformers": (">=5.23", "<5.25"),
    "accelerate": (">=1.15", "<1.16"),
    "torch": (">=2.13", "<2.14"),
    "peft": (">=0.21", "<0.22"),
    "trl": (">=1.16", "<1.17"),
}
"""The one declaration of the ranges the whole suite was run on (docs/compatibility.md records the runs).
transformers and accelerate, whose private members hf_dist overrides, are required in exactly these ranges by
setup.cfg ``install_requires``; torch, peft and trl are only floored there (a ceiling would make pip downgrade a
newer install), so outside these ranges the start-up guard warns instead (``tests/test_trainer_internals.py``
checks setup.cfg and the README against this)."""


@dataclass(frozen=True, kw_only=True)
class PrivateMember:
    """One private member hf_dist depends on."""

    owner: str
    """Where it lives: ``"transformers.Trainer"``, ``"accelerate.Accelerator"``, ..."""
    name: str
    """The member's name."""
    kind: Literal["override", "patch", "set", "call", "read"]
    """override: an hf_dist method replacing the base one; patch: an instance attribute replaced; set: a flag
    or value written; call: a private function called; read: a private attribute or module read."""
    where: str
    """The hf_dist module that touches it."""
    why: str
    """What would go wrong without it."""
    called_by: str = ""
    """For overrides: the Trainer method whose body calls it (checked by the tests)."""


_T, _A = "transformers.Trainer", "accelerate.Accelerator"
_MODEL, _MODULE, _DTENSOR = "transformers.PreTrainedModel", "torch.nn.Module", "torch.distributed.tensor.DTensor"
_COLWISE = "torch.distributed.tensor.parallel.ColwiseParallel"
_ROWWISE = "torch.distributed.tensor.parallel.RowwiseParallel"
_ATEN = "torch.ops.aten"


def _m(owner: str, name: str, kind: str, where: str, why: str) -> PrivateMember:
    return PrivateMember(owner=owner, name=name, kind=kind, where=where, why=why)


OUTSIDE_THE_TRAINER: tuple[PrivateMember, ...] = (
    # the model's own declarations that transformers keeps private
    _m(_MODEL, "_no_split_modules", "read", "parallelism, configs.model_info, planner.catalogue",
       "the decoder-layer classes FSDP2 wraps as units and FSDP configs name"),
    _m(_MODEL, "_tp_plan", "read", "tensor_parallel.support", "the head's TP plan beside base_model_tp_plan"),
    _m(_MODEL, "_pp_plan", "read", "pipeline_parallel.plans", "the head modules of a pipeline's last stage"),
    _m(_MODEL, "_tied_weights_keys", "read", "state_dict", "which weights a gathered state dict leaves tied"),
    _m(_MODEL, "_can_record_outputs", "read", "models.router",
       "where the router logits are recorded (the MoE aux loss under layouts that split the forward)"),
    _m("transformers.PretrainedConfig", "_experts_implementation", "read", "support",
       "the experts implementation a model runs, refused under TP/EP unless a parity test proves it"),
    _m("transformers.PretrainedConfig", "_attn_implementation", "set", "context_parallel.attention, data.packing",
       "CP swaps in its all-to-all attention under a registered name; packing reads which kernel runs"),
    _m("transformers.masking_utils.AttentionMaskInterface", "_global_mapping", "read", "context_parallel.attention",
       "the mask function of the attention CP wraps, registered under the wrapped name"),
    _m("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref", "read", "models.tiny",
       "a tiny model is built outside ZeRO-3's init even while a DeepSpeed config is active, then restored"),
    _m("accelerate.utils.DeepSpeedPlugin", "_deepspeed_config_checks", "call", "configs.accelerate, configs.strict",
       "the generated DeepSpeed config is checked as accelerate checks it at launch"),
    # torch.nn.Module and tensors
    _m(_MODULE, "_apply", "call", "apply, loading.stream",
       "moves or materialises every tensor in place, as FSDP2's own _apply re-registers its shards"),
    _m(_MODULE, "_parameters", "set", "loading.stream, tensor_parallel.moe, tensor_parallel.hybrid_styles",
       "a parameter swapped for its shard or a local view without re-registering hooks"),
    _m(_MODULE, "_modules", "set", "pipeline_parallel.stage_module",
       "a stage is a view of the model's own children under their names (checkpoint keys unchanged)"),
    _m(_MODULE, "_buffers", "set", "tensor_parallel.hybrid_styles",
       "a buffer (Falcon-H1's muP vector) sliced per rank"),
    _m(_MODULE, "_get_name", "patch", "parallelism",
       "the model still prints as its own class, not FSDP2's FSDP<Class> wrapper"),
    _m("torch.Tensor", "_base", "read", "planner.measure", "views are counted once, by the storage they view"),
    _m("torch._C._profiler", "_EventType", "read", "planner.measure",
       "which profiler records are allocations: their running total is the CPU allocator's own count"),
    _m(_DTENSOR, "_local_tensor", "read",
       "data_parallel.buckets, loading.slices, pipeline_parallel.tied, checkpoint.async_save, metrics.ledger, "
       "planner.measure, cli.calibrate_ranks", "the local shard without an autograd edge (to_local() adds one)"),
    # torch.distributed
    _m("torch.distributed.device_mesh.DeviceMesh", "_flatten", "call", "parallel_dims",
       "the flattened dp / dp_shard_cp / dp_cp axes, kept as meshes (slicing them from the root is deprecated)"),
    _m("torch.distributed.distributed_c10d", "_world", "read", "trainer.teardown",
       "process groups destroyed in creation order, the world's last"),
    _m("peft ParamWrapper instances (set in __init__)", "_did_swap_in_out_features", "read",
       "checkpoint.export.lora_verify",
       "whether PEFT stores a parameter adapter transposed, to merge it as PEFT does"),
    _m("torch.distributed.tensor.placement_types", "_StridedShard", "call",
       "tensor_parallel.moe, loading.slices, expert_parallel.adapters",
       "fused gate|up experts split so each rank holds [gate_r | up_r] while the global tensor keeps HF's order"),
    _m("torch.distributed.tensor.placement_types.Shard", "_split_tensor", "call", "loading.slices",
       "the rows a rank holds, by the placement's own split, so a streamed load reads only those"),
    _m("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "call", "loading.slices",
       "a DTensor's local shape and offset by the rule DCP uses"),
    _m("torch.distributed.checkpoint._nested_dict", "set_element", "call", "checkpoint.safe_io",
       "a flat key written back into a nested state dict as DCP nests it"),
    _m("torch.distributed.tensor.parallel.ParallelStyle", "_apply", "override", "tensor_parallel (every style)",
       "parallelize_module applies a style through it"),
    _m(_COLWISE, "_partition_linear_fn", "override", "tensor_parallel.styles",
       "fused projections split part by part"),
    _m(_COLWISE, "_prepare_input_fn", "call", "tensor_parallel.classic_styles", "Conv1D layers get Linear's inputs"),
    _m(_COLWISE, "_prepare_output_fn", "override", "tensor_parallel.styles, classic_styles",
       "outputs the model writes in place are handed a copy"),
    _m(_ROWWISE, "_prepare_output_fn", "override", "tensor_parallel.classic_styles", "the same for row-parallel"),
    _m("torch.autograd.Variable", "_execution_engine", "call", "data_parallel.reducer",
       "the bucketed all-reduce is finished by a callback at the end of backward, as DDP does"),
    # what the step ledger counts
    _m("torch.utils._python_dispatch", "TorchDispatchMode", "override", "metrics.ledger",
       "every op and collective of a step is seen once, at dispatch"),
    _m("torch.utils._pytree", "tree_flatten", "call", "metrics.ledger", "the tensors among an op's arguments"),
    _m("torch.ops.aten.mm.default", "_schema", "read", "metrics.ledger", "an op's name, to count it"),
    _m("torch.ops._c10d_functional", "all_reduce", "read", "metrics.ledger",
       "DTensor's collectives, counted by name in this namespace"),
    _m(_ATEN, "_grouped_mm", "read", "metrics.ledger", "the grouped expert matmul's FLOPs"),
    _m("torch", "_C", "read", "metrics.ledger", "torch's C extension, for the graph task below"),
    _m("torch._C", "_current_graph_task_id", "call", "metrics.ledger",
       "whether an op runs in backward (an autograd graph task is running) or forward, for the dtype ledger"),
    _m(_ATEN, "_scaled_dot_product_flash_attention_for_cpu", "read", "metrics.ledger", "CPU SDPA's FLOPs"),
    _m(_ATEN, "_scaled_dot_product_flash_attention_for_cpu_backward", "read", "metrics.ledger",
       "CPU SDPA's backward FLOPs"),
    _m("torch._dynamo.utils", "counters", "read", "compile", "graph breaks and recompiles reported after a compiled step"),
)
"""The private members touched outside ``hf_dist.trainer``: owners are importable paths, so the guard checks each."""
PRIVATE_MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember(owner=_T, name="_sync_replicated_trainable_parameters", kind="override", where="trainer.trainer",
                  called_by="_prepare_for_training",
                  why="under PP every rank holds different stages: broadcasting rank 0's parameters would overwrite them"),
    PrivateMember(owner="torch.nn.Parameter", name="_replicated_grad_hook_registered", kind="set",
                  where="trainer.trainer",
                  why="the Trainer's _sync_replicated_trainable_parameters registers an all-reduce hook on every plain "
                      "parameter unless marked: hf_dist reduces gradients itself, the hooks reduced them twice"),
    PrivateMember(owner=_T, name="_run_epoch", kind="override", where="trainer.trainer",
                  called_by="_inner_training_loop",
                  why="a run resumed at max_steps mid-epoch trained one step more than max_steps (the Trainer checks "
                      "the count only after a step)"),
    PrivateMember(owner=_T, name="_clip_grad_norm", kind="override", where="trainer.trainer",
                  called_by="_run_epoch",
                  why="under PP the gradient norm spans every stage's rank, not only this rank's parameters; under TP "
                      "the partial gradients of whole weights (SP norms) are summed first, in one all-reduce"),
    PrivateMember(owner=_T, name="_get_grad_norm", kind="override", where="trainer.trainer",
                  called_by="_run_epoch",
                  why="without clipping, the first reader of the step's gradients: the TP partial gradients are summed "
                      "here in one all-reduce, not one per tensor in the norm and again in the optimizer step"),
    PrivateMember(owner=_T, name="_defer_fsdp_gradient_reduction", kind="override", where="trainer.trainer",
                  called_by="_run_epoch",
                  why="gradient accumulation on hf_dist's FSDP2 model: reduce once per optimizer step (HSDP: skip the "
                      "all-reduce, not only the reduce-scatter)"),
    PrivateMember(owner=_T, name="_prepare_context_parallel_inputs", kind="override", where="trainer.context",
                  called_by="training_step",
                  why="under CP each rank keeps its slice of the shifted labels and runs the step inside the "
                      "sequence split; without it every cp rank would train on whole sequences with a 1/cp loss"),
    PrivateMember(owner=_T, name="_get_num_items_in_batch", kind="override", where="trainer.loss",
                  called_by="get_batch_samples",
                  why="with average_tokens_across_devices=False the Trainer still divides this rank's own token count "
                      "by tp, as if it had been gathered over the tp ranks: every TP loss and gradient came out tp "
                      "times too large"),
    PrivateMember(owner=_T, name="_save_checkpoint", kind="override", where="trainer.checkpoint_glue",
                  called_by="_maybe_log_save_evaluate",
                  why="FSDP2/TP/PP models are checkpointed sharded and atomically by hf_dist.checkpoint"),
    PrivateMember(owner=_T, name="_load_from_checkpoint", kind="override", where="trainer.checkpoint_glue",
                  called_by="_prepare_for_training",
                  why="an hf_dist checkpoint holds DCP shards, not a model file the Trainer can read"),
    PrivateMember(owner=_T, name="_load_optimizer_and_scheduler", kind="override", where="trainer.checkpoint_glue",
                  called_by="_prepare_for_training",
                  why="model and optimizer load together from DCP, resharded to this run's layout"),
    PrivateMember(owner=_T, name="_load_rng_state", kind="override", where="trainer.checkpoint_glue",
                  called_by="_run_epoch", why="per-rank RNG lives in the hf_dist checkpoint's rng/ folder"),
    PrivateMember(owner=_T, name="_load_best_model", kind="override", where="trainer.checkpoint_glue",
                  called_by="_finalize_training", why="the best checkpoint is an hf_dist one (DCP shards)"),
    PrivateMember(owner=_T, name="_save", kind="override", where="trainer.trainer", called_by="save_model",
                  why="gather DTensor shards (hf_dist.state_dict) into a normal HF directory; PP: from every stage"),
    PrivateMember(owner=_T, name="_get_output_dir", kind="call", where="trainer.checkpoint_glue",
                  why="the run folder checkpoints go to (hyperparameter search trials included), as the Trainer's"),
    PrivateMember(owner=_T, name="_remove_unused_columns", kind="call", where="trainer.data",
                  why="the train loader hf_dist builds drops the columns the model does not take, as the Trainer's"),
    PrivateMember(owner=_T, name="_get_collator_with_removed_columns", kind="call", where="trainer.data",
                  why="the same for datasets that are not a datasets.Dataset"),
    PrivateMember(owner=_T, name="_prepare_inputs", kind="call", where="trainer.step",
                  why="a pipeline step moves its batch to the device as training_step would"),
    PrivateMember(owner=_T, name="_train_batch_size", kind="set", where="trainer.data",
                  why="under PP the data loader's batch is micro batch x micro-batches (accumulation runs inside the "
                      "pipeline)"),
    PrivateMember(owner=_T, name="_mixed_mesh_grad_norm", kind="call", where="tests (reference for TP norms)",
                  why="the Trainer's own norm over DTensor and plain gradients; tests compare against it"),
    PrivateMember(owner="transformers.PreTrainedModel", name="_is_distributed_loading_by_transformers", kind="set",
                  where="apply, pipeline_parallel.apply",
                  why="tells the Trainer the model owns placement and gradient reduction: no DDP wrap, no re-shard"),
    PrivateMember(owner=_A, name="prepare_data_loader", kind="patch", where="trainer.data",
                  why="under TP/PP the ranks of one model replica must read the same batch: shard by dp rank"),
    PrivateMember(owner=_A, name="gather_for_metrics", kind="patch", where="trainer.data",
                  why="gather eval results over dp only (TP/PP ranks hold copies); trimmed as accelerate trims"),
    PrivateMember(owner=_T, name="_loss_shifts_labels", kind="set", where="trainer.loss",
                  why="a causal LM with loss_type=None still shifts its labels (ForCausalLMLoss): num_items_in_batch "
                      "must count labels[..., 1:] as under PP, or the loss differs by layout"),
    PrivateMember(owner=_T, name="gather_function", kind="set", where="trainer.data",
                  why="the Trainer gathers eval results through it: over dp only under TP/PP, as gather_for_metrics"),
    PrivateMember(owner=_A, name="_dataloaders", kind="set", where="trainer.data",
                  why="accelerate tracks prepared loaders there (end-of-dataloader state for gather trimming)"),
    PrivateMember(owner="accelerate (any prepared model)", name="_is_accelerate_prepared", kind="set", where="trainer.trainer",
                  why="evaluate() before train() marks a bare model prepared; train() would then skip the DDP wrap"),
    PrivateMember(owner="transformers.TrainingArguments", name="save_only_model", kind="set",
                  where="trainer.checkpoint_glue",
                  why="flipped only while Trainer.__init__ runs: it refuses save_strategy for a model it did not "
                      "shard; hf_dist checkpoints it"),
    PrivateMember(owner="torch.nn.parallel.DistributedDataParallel", name="_sync_buffers", kind="patch", where="trainer.throughput",
                  why="times the buffer broadcast so the DDP communication wait is reported"),
    PrivateMember(owner="torch.distributed._state_dict_utils", name="_copy_state_dict", kind="call",
                  where="checkpoint.async_save",
                  why="copies the state into the staging buffers cached across async saves (the helper behind "
                      "BlockingAsyncStager's cache, which always pins memory and so needs a GPU)"),
    *OUTSIDE_THE_TRAINER,
)
_GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
TRL_MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember(owner=_GRPO, name="_generate_and_score_completions", kind="override", where="trainer.grpo",
                  why="under TP the ranks of one dp rank share its prompts: rewards are gathered once per dp rank "
                      "(TRL gathered a copy per TP rank into reward_std and batch-scaled advantages)"),
    PrivateMember(owner=_GRPO, name="_generate", kind="override", where="trainer.grpo",
                  why="num_tokens counted once per dp rank under TP (TRL's all-process count doubled it)"),
    PrivateMember(owner="a GRPOTrainer instance (set in its __init__)", name="_metrics", kind="set",
                  where="trainer.grpo",
                  why="the logged num_tokens replaced by the per-dp-rank count"),
    PrivateMember(owner="trl.trainer.grpo_trainer", name="gather", kind="patch", where="trainer.grpo",
                  why="TRL's module-level gather swapped for a gather over the dp group for one call"),
    PrivateMember(owner="a DPOTrainer instance (set in its __init__)", name="_metrics", kind="set",
                  where="trainer.dpo_pipeline",
                  why="under PP the last stage computes the loss, not compute_loss: its figures are appended here, "
                      "where DPOTrainer.log reads them"),
    PrivateMember(owner="a DPOTrainer instance (set in its __init__)", name="_total_train_tokens", kind="set",
                  where="trainer.dpo_pipeline", why="the num_tokens DPOTrainer logs, counted by the pipeline step"),
)
"""The private TRL members ``DistGRPOTrainer`` and ``DistDPOTrainer`` touch: checked when one is built (``check_internals(TRL_MEMBERS)``),
not at every ``DistTrainer`` start (importing trl there would cost every run)."""


def overrides() -> tuple[PrivateMember, ...]:
    """The DistTrainer methods that replace private Trainer methods."""
    return tuple(m for m in PRIVATE_MEMBERS if m.kind == "override" and m.owner == _T)


def _ranges() -> str:
    return ", ".join(f"{pkg}{lo},{hi}" for pkg, (lo, hi) in TESTED_VERSIONS.items())


def installed_versions() -> dict[str, str]:
    """``{package: installed version}`` for the packages of ``TESTED_VERSIONS`` that are installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in TESTED_VERSIONS:
        try:
            out[package] = version(package)
        except PackageNotFoundError:  # peft and trl are optional
            continue
    return out


def untested_versions(installed: dict[str, str] | None = None) -> dict[str, str]:
    """``{package: installed version}`` for each installed package outside its ``TESTED_VERSIONS`` range (pure
    given ``installed``; a local build tag such as ``+cpu`` does not count)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = installed_versions() if installed is None else installed
    out = {}
    for package, found in installed.items():
        if package in TESTED_VERSIONS and Version(found).public not in SpecifierSet(",".join(TESTED_VERSIONS[package]),
                                                                                     prereleases=True):
            out[package] = found
    return out


_warned = False


def warn_untested_versions(installed: dict[str, str] | None = None) -> str | None:
    """Warn once per process, on the main process only, naming each installed version outside the tested range
    and the range; returns the message (``None`` when all are tested, already warned, or not the main process)."""
    global _warned
    outside = untested_versions(installed)
    if not outside or _warned or int(os.environ.get("RANK", "0")) != 0:
        return None
    _warned = True
    found = ", ".join(f"{pkg} {ver} (tested {','.join(TESTED_VERSIONS[pkg])})" for pkg, ver in outside.items())
    message = (f"hf_dist was tested with {_ranges()}; installed here: {found}. It may work, but nothing was run "
               f"on these versions; install the tested ones to be sure")
    logger.warning(message)
    return message


_ABSENT = object()


def _resolve(path: str):
    """The object at the dotted ``path`` (a module, then attributes); ``None`` when its package is not installed (an
    optional one), ``_ABSENT`` when the package is there but the path is gone, or ``path`` is no importable path."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                return None if importlib.util.find_spec(parts[0]) is None else _ABSENT
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, _ABSENT)
            if obj is _ABSENT:
                return _ABSENT
        return obj
    return _ABSENT


def _has(owner, name: str) -> bool:
    """An attribute, or an instance attribute its class declares (``nn.Module._parameters``,
    ``DTensor._local_tensor``)."""
    return hasattr(owner, name) or any(name in getattr(k, "__annotations__", {}) for k in getattr(owner, "__mro__", ()))


def missing_members(members: tuple[PrivateMember, ...] = PRIVATE_MEMBERS) -> list[str]:
    """``owner.name`` of each listed member the installed packages no longer have (``set`` members on hf_dist's own
    names and owners that are no importable path are not checked)."""
    missing = []
    for m in members:
        if m.kind == "set" and m.owner in (_T, _A, "torch.nn.Parameter", "transformers.TrainingArguments"):
            continue  # hf_dist's flags on these objects, or public fields flipped: nothing of theirs to find
        owner = _resolve(m.owner)
        if owner is None or (owner is _ABSENT and " " in m.owner):
            continue  # an optional package not installed, or an owner described in words
        if owner is _ABSENT or not _has(owner, m.name):
            missing.append(f"{m.owner}.{m.name}")
    return missing


def check_internals(members: tuple[PrivateMember, ...] = PRIVATE_MEMBERS) -> None:
    """Stop with the versions if a private member hf_dist overrides, patches, calls or reads is gone (``members``:
    the whole list, or ``TRL_MEMBERS`` for the TRL trainers); warn once (main process) when a package is outside
    its tested range."""
    missing = missing_members(members)
    if missing:
        import accelerate
        import transformers

        raise RuntimeError(
            f"hf_dist relies on {', '.join(missing)}, which transformers {transformers.__version__} / accelerate "
            f"{accelerate.__version__} / torch {_torch_version()} no longer have; install the tested versions "
            f"({_ranges()})"
        )
    warn_untested_versions()


def _torch_version() -> str:
    import torch

    return torch.__version__

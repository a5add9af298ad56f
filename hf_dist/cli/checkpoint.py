"""``hf-dist checkpoint``: ``inspect`` a checkpoint, ``export`` it to a Hub-ready folder."""

from __future__ import annotations

import argparse
import sys

from hf_dist.checkpoint import manifest as mf


def register(subparsers) -> None:
    parser = subparsers.add_parser("checkpoint", help="inspect or export hf_dist checkpoints")
    sub = parser.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    inspect = sub.add_parser("inspect", help="print layout, step, sizes and completeness of a checkpoint")
    inspect.add_argument("ckpt", help="a checkpoint folder, or a folder with a `latest` file")
    inspect.add_argument("--verify", choices=("size", "sha256"), default="sha256",
                         help="how to check each file: its SHA-256 in the manifest (default) or only its size")
    inspect.set_defaults(func=run_inspect)
    export = sub.add_parser("export", help="write sharded safetensors + index, config and tokenizer for the Hub")
    export.add_argument("ckpt", help="an hf_dist checkpoint (any layout), a Trainer checkpoint-N (DDP, one process) "
                        "or a DeepSpeed ZeRO checkpoint folder")
    export.add_argument("out", help="output folder (new or empty; see --overwrite)")
    export.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default 2GB)")
    export.add_argument("--tokenizer", default=None, help="tokenizer folder to ship (default: the checkpoint's)")
    export.add_argument("--adapter", choices=("adapter", "merged"), default=None,
                        help="for a LoRA checkpoint: the adapter only, or merged into the base weights")
    export.add_argument("--config", default=None, help="config.json folder, for ZeRO checkpoints without one")
    export.add_argument("--trust-deepspeed-pickles", action="store_true",
                        help="allow reading a DeepSpeed ZeRO folder (its files are pickles that can run code)")
    export.add_argument("--verify", choices=("tensors", "logits", "none"), default="tensors",
                        help="tensors (default): the folder's structure on meta and every tensor against the "
                        "checkpoint, one tensor in memory at a time; logits: load the checkpoint and the export as "
                        "two whole models and compare logits (needs ~2x the model in host RAM); none: skip")
    export.add_argument("--no-verify", action="store_true", help="same as --verify none")
    export.add_argument("--overwrite", action="store_true",
                        help="export into a non-empty folder: its model files are replaced, other files kept")
    export.set_defaults(func=run_export)


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return str(nbytes)


def run_inspect(args: argparse.Namespace) -> int:
    try:
        ckpt = mf.resolve_checkpoint(args.ckpt)
        complete = mf.is_complete(ckpt)
        manifest = mf.read_manifest(ckpt)
        problem = None
        try:
            mf.verify_files(ckpt, manifest, args.verify)
        except mf.CheckpointError as err:
            problem = str(err)
    except mf.CheckpointError as err:
        print(f"hf-dist checkpoint inspect: {err}", file=sys.stderr)
        return 2
    layout = manifest.layout
    rows = [
        ("checkpoint", str(ckpt)),
        ("complete", "yes" if complete and problem is None else f"NO: {problem}"),
        ("step", str(manifest.step)),
        ("samples consumed", f"{manifest.samples_consumed:,}"),
        ("layout", " x ".join(f"{k}={layout[k]}" for k in ("pp", "dp_replicate", "dp_shard", "tp"))
         + f" (world size {layout['world_size']})" + (f", {layout['description']}" if "description" in layout else "")),
        ("contents", ", ".join(manifest.contents)),
        ("files", f"{len(manifest.files)}, {_human(manifest.total_bytes)}"),
    ]
    if manifest.batch_contract:
        bc = manifest.batch_contract
        rows.append(("global batch", f"{bc['global_batch_size']} (micro {bc['micro_batch_size']})"))
    if manifest.metrics:
        rows.append(("metrics", ", ".join(f"{k}={v:g}" for k, v in sorted(manifest.metrics.items()))))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    by_dir: dict[str, int] = {}
    for entry in manifest.files:
        top = entry.path.split("/")[0]
        by_dir[top] = by_dir.get(top, 0) + entry.size
    for top, size in sorted(by_dir.items()):
        print(f"  {top:<{width - 2}}  {_human(size)}")
    return 0 if problem is None and complete else 1


def run_export(args: argparse.Namespace) -> int:
    from hf_dist.checkpoint.export import export_checkpoint

    try:
        report = export_checkpoint(
            args.ckpt, args.out, max_shard_size=args.max_shard_size, tokenizer_dir=args.tokenizer,
            adapter=args.adapter, config_dir=args.config, verify="none" if args.no_verify else args.verify,
            overwrite=args.overwrite,
            trust_pickles=args.trust_deepspeed_pickles,
        )
    except (mf.CheckpointError, ValueError, FileNotFoundError) as err:
        print(f"hf-dist checkpoint export: error: {err}", file=sys.stderr)
        return 2
    if report.checksums_verified is not None:
        print(f"checked {report.checksums_verified} checkpoint files against their SHA-256 in the manifest")
    else:
        print("this checkpoint records no checksums (it was not written by hf_dist): a corruption that keeps "
              "every shape and value finite cannot be detected")
    print(f"wrote {len(report.files)} files ({_human(report.total_bytes)} of tensors, largest shard "
          f"{_human(report.largest_shard_bytes)}) to {report.out_dir}")
    if report.verification == "tensors":
        print(f"verified tensor by tensor: the folder holds exactly what from_pretrained fills, and all "
              f"{report.tensors_verified} tensors equal the checkpoint's (--verify logits for a logits comparison)")
    elif report.verification == "logits":
        print(f"verified with from_pretrained: max |logit diff| on the probe batch = {report.max_logit_diff:.3g}")
    else:
        print("not verified (--verify none)")
    return 0

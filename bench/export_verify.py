"""Peak memory of ``hf-dist checkpoint export``'s verification: tensor by tensor (default) vs logits.

    .venv/bin/python bench/export_verify.py                          # 246M-parameter Llama (938 MiB fp32)
    .venv/bin/python bench/export_verify.py --layers 2 --hidden 256  # a quick check of the bench itself

A Llama built from a config with random weights is saved as a one-rank hf_dist checkpoint and exported once
without verification (``--max-shard-size``). Each verification then runs alone in a fresh process on that
export (``hf_dist.checkpoint.export.dcp.check_export``); the process reports ``base`` (resident set after imports)
and ``peak`` (its largest resident set from then on, ``VmHWM`` reset after ``base``). ``tensors``: the folder's
structure on ``meta``, then every tensor read alone from the DCP checkpoint and from the export and compared;
``logits``: the checkpoint built as a model and the export loaded with ``from_pretrained``, logits compared (two
models in memory).
``native:SIZE``: the whole ``hf-dist checkpoint export`` of the same model saved by ``save_pretrained`` (a
Trainer-native folder): source check, streamed copy in SIZE shards, default verification.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in MiB (``ru_maxrss`` would keep the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def child(mode: str, ckpt: str, out: str) -> None:
    """Run one verification; print base/peak MiB and seconds as JSON."""
    import torch  # noqa: F401  (imports belong to the base)
    import transformers.models.llama.modeling_llama  # noqa: F401

    from hf_dist.checkpoint.export import verify  # noqa: F401
    from hf_dist.checkpoint.export import ExportReport
    from hf_dist.checkpoint.export.dcp import check_export

    from hf_dist.checkpoint.export import export_checkpoint

    base = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    start = time.perf_counter()
    if mode.startswith("native"):  # the whole export of a Trainer-native folder: check, copy, verify
        report = export_checkpoint(ckpt, out, max_shard_size=mode.split(":")[1])
    else:
        report = ExportReport(out_dir=Path(out))
        check_export(Path(ckpt), Path(out), mode, report)
    print(json.dumps({"base": base, "peak": _status_mib("VmHWM"), "s": time.perf_counter() - start,
                      "tensors": report.tensors_verified, "diff": report.max_logit_diff}))


def prepare(root: Path, args: argparse.Namespace) -> tuple[Path, Path, int, int]:
    """Save the checkpoint and its unverified export; return paths, model bytes and largest tensor bytes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_dist import ParallelDims
    from hf_dist.checkpoint import save_checkpoint
    from hf_dist.checkpoint.export import export_checkpoint

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 256 or 1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    ckpt = root / "ckpt"
    model.save_pretrained(root / "native", max_shard_size="500MB")
    save_checkpoint(ckpt, model=model, optimizer=None, step=0, samples_consumed=0,
                    layout=ParallelDims(world_size=1), batch_contract=None)
    del model
    export_checkpoint(ckpt, root / "out", max_shard_size=args.max_shard_size, verify="none")
    return ckpt, root / "out", sum(sizes), max(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-size", default="500MB")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out, model_bytes, largest = prepare(Path(tmp), args)
        mib = 2**20
        print(f"model: {model_bytes / 4 / 1e6:.0f}M parameters, {model_bytes / mib:.0f} MiB fp32, largest tensor "
              f"{largest / mib:.0f} MiB")
        print(f"{'verify':<14} {'seconds':>8} {'base MiB':>9} {'peak MiB':>9} {'peak-base MiB':>14} {'x model':>8} "
              f"{'x largest tensor':>17}")
        jobs = [("tensors", ckpt, out), ("logits", ckpt, out),
                (f"native:{args.max_shard_size}", Path(tmp) / "native", Path(tmp) / "native_out")]
        for mode, source, target in jobs:
            run = subprocess.run([sys.executable, __file__, "--child", mode, str(source), str(target)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            grow = r["peak"] - r["base"]
            print(f"{mode:<14} {r['s']:>8.1f} {r['base']:>9.0f} {r['peak']:>9.0f} {grow:>14.0f} "
                  f"{grow * mib / model_bytes:>8.2f} {grow * mib / largest:>17.2f}")


if __name__ == "__main__":
    main()

"""Peak memory and time of one training step on the real SmolLM2-135M-Instruct (first 4 layers, vocab 49,152).

Each case runs in fresh processes (so the peak resident set is that case's): one optimizer step of micro batch
4 x 2,048 tokens (random token ids, loss on every token), fp32, AdamW, on 1 process or on 2 gloo ranks (FSDP2,
micro 4 per rank), one thread per process. It prints, per case, the peak RSS of the worst rank, the RSS before
``train()`` (model loaded: Python, torch, the libraries and the weights), the step time (the first step, so compile
time is in it for compiled cases), the loss, and the planner's forecast of allocated bytes for that case
(``hf_dist.planner.estimate_memory``, ``device="cpu"``; RSS also holds the runtime, which the planner does not count).

    .venv/bin/python bench/step.py [--cases trainer,dist_whole,dist,fsdp2_whole,fsdp2] [--model-dir DIR]

Cases: ``trainer`` (transformers.Trainer), ``dist_whole`` (DistTrainer, chunked_loss=False), ``dist``
(DistTrainer: chunked loss), ``fsdp2_whole`` / ``fsdp2`` (the same on 2 ranks), ``compiled`` / ``fsdp2_compiled``
(``torch_compile=True``: per-block compile inside ``hf_dist.parallelize``), ``fsdp2_noprefetch`` (FSDP2 with
implicit prefetch only), ``pp2_whole`` / ``pp2`` (PP=2, 2 micro-batches of 4: the last stage's loss on whole
logits / chunked). Results recorded in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

LAYERS, SEQ, MICRO = 4, 2048, 4
FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
CASES: dict[str, dict] = {
    "trainer": {"world": 1, "trainer": "plain"},
    "dist_whole": {"world": 1, "args": {"chunked_loss": False}},
    "dist": {"world": 1, "args": {}},
    "compiled": {"world": 1, "args": {"torch_compile": True}},
    "fsdp2_whole": {"world": 2, "args": {**FSDP2, "chunked_loss": False}},
    "fsdp2": {"world": 2, "args": FSDP2},
    "fsdp2_noprefetch": {"world": 2, "args": {**FSDP2, "fsdp2_explicit_prefetch": False}},
    "fsdp2_compiled": {"world": 2, "args": {**FSDP2, "torch_compile": True}},
    "pp2_whole": {"world": 2, "args": {"pp_size": 2, "chunked_loss": False}},
    "pp2": {"world": 2, "args": {"pp_size": 2}},
}
DEFAULT_CASES = "trainer,dist_whole,dist,fsdp2_whole,fsdp2"


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _dataset(rows: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (rows, SEQ), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _one_step(model_dir: str, case: str, world: int) -> dict:
    """One optimizer step of ``case`` in this process (a rank when ``world`` > 1)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_dist import DistTrainer, DistTrainingArguments
    from hf_dist.planner.measure import peak_rss_bytes

    spec = CASES[case]
    common = dict(max_steps=1, per_device_train_batch_size=MICRO, learning_rate=1e-4, lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
                  dataloader_num_workers=0, use_cpu=world == 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, num_hidden_layers=LAYERS, dtype=torch.float32)
    times, losses = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        if spec.get("trainer") == "plain":
            trainer_cls, args = Trainer, TrainingArguments(output_dir=out, **common)
        else:
            trainer_cls = DistTrainer
            args = DistTrainingArguments(output_dir=out, global_batch_size=MICRO * world, **common, **spec["args"])

        class Recording(trainer_cls):
            def training_step(self, *a, **kw):
                loss = super().training_step(*a, **kw)
                losses.append(float(loss))
                return loss

        trainer = Recording(model=model, args=args, train_dataset=_dataset(MICRO * world), callbacks=[Timer()])
        before = _rss_now()
        trainer.train()
    return {"peak": peak_rss_bytes(), "before": before, "step_s": times[1] - times[0], "loss": losses[0]}


def _rank(rank, world, model_dir, case):
    return _one_step(model_dir, case, world)


def measure(model_dir: str, case: str) -> dict:
    """``case`` in fresh processes; the worst rank's peak RSS."""
    world = CASES[case]["world"]
    if world == 1:
        out = subprocess.run([sys.executable, __file__, "--one", case, "--model-dir", model_dir], check=True,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.stdout.strip().splitlines()[-1])
    from dist_utils import run_distributed

    results = run_distributed(_rank, world, model_dir, case, timeout_s=1800)
    worst = max(results, key=lambda r: r["peak"])
    return worst | {"loss": results[0]["loss"]}


def forecast(model_dir: str, case: str) -> int:
    """The planner's allocated bytes on the worst rank for ``case``."""
    from transformers import AutoConfig

    from hf_dist.planner import Workload, make_layout, model_spec
    from hf_dist.planner.memory import MemoryAssumptions, estimate_memory

    spec = CASES[case]
    config = AutoConfig.from_pretrained(model_dir, num_hidden_layers=LAYERS)
    args = spec.get("args", {})
    workload = Workload(seq_len=SEQ, micro_batch_size=MICRO, precision="fp32", attention="sdpa",
                        activation_checkpointing=False,
                        chunked_loss=spec.get("trainer") != "plain" and args.get("chunked_loss", True))
    if args.get("pp_size", 1) > 1:
        layout = make_layout("ddp", spec["world"], pp=args["pp_size"])
    else:
        layout = make_layout("fsdp_full_shard" if spec["world"] > 1 else "ddp", spec["world"])
    return estimate_memory(model_spec(config), workload, layout, MemoryAssumptions(device="cpu")).allocated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a single-process case, in this process
    ns = parser.parse_args()
    if ns.model_dir is None:
        from hf_dist.models import demo_model_dir

        ns.model_dir = str(demo_model_dir())
    if ns.one:
        torch.set_num_threads(1)
        print(json.dumps(_one_step(ns.model_dir, ns.one, 1)))
        return
    gb = 1e9
    print(f"SmolLM2-135M-Instruct, first {LAYERS} layers, micro {MICRO} x {SEQ} tokens, fp32, one step, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'case':<18}{'ranks':>6}{'peak RSS GB':>13}{'RSS before GB':>15}{'planner GB':>12}{'step s':>9}"
          f"{'loss':>14}")
    for case in ns.cases.split(","):
        r = measure(ns.model_dir, case)
        print(f"{case:<18}{CASES[case]['world']:>6}{r['peak'] / gb:>13.2f}{r['before'] / gb:>15.2f}"
              f"{forecast(ns.model_dir, case) / gb:>12.2f}{r['step_s']:>9.1f}{r['loss']:>14.7f}", flush=True)


if __name__ == "__main__":
    main()

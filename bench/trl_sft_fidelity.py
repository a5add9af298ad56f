"""TRL's own SFT, DPO or GRPO tests run twice, with TRL's trainer and with hf_dist's: a per-test table.

    python bench/trl_sft_fidelity.py PATH/TO/test_sft_trainer.py [-k EXPR] [--work DIR] [--timeout 300]
                                     [--qwen-vocab]
    python bench/trl_sft_fidelity.py --trainer dpo PATH/TO/test_dpo_trainer.py
    python bench/trl_sft_fidelity.py --trainer grpo PATH/TO/test_grpo_trainer.py

The test file is TRL's ``tests/test_<trainer>_trainer.py`` for the installed trl, obtained by the user (nothing here
fetches it, and no TRL code is part of hf_dist). It is copied into a test package under ``--work`` whose
``testing_utils.py`` and ``conftest.py`` come from ``bench/trl_test_harness.py``, with offline stand-ins for the Hub
models and datasets the tests name from ``bench/trl_sft_standins.py``, and, in the second run, ``trl.SFTTrainer`` /
``trl.SFTConfig`` (or the DPO or GRPO pair) replaced by ``hf_dist``'s ``DistSFTTrainer`` / ``DistSFTConfig``
(``DistDPO...``, ``DistGRPO...``) before the test module imports them. The swap is counted, not assumed: every
``transformers.Trainer`` built is logged with its class and its arguments' class, and the script fails when the
plain run built an hf_dist trainer or the swapped run built TRL's. Both runs are one process each
(``OMP_NUM_THREADS=1``, ``-p no:cacheprovider``, no ``-x``).

Prints every test's outcome in both runs, the counts, the trainers built, and the tests that pass with TRL's
class and fail with hf_dist's (exit status 1 when there is any). Not a test: it runs for minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TRAINERS = {"sft": ("SFTTrainer", "DistSFTTrainer"), "dpo": ("DPOTrainer", "DistDPOTrainer"),
            "grpo": ("GRPOTrainer", "DistGRPOTrainer")}
TESTING_UTILS = """from trl_test_harness import (  # noqa: F401  (stand-in for TRL's tests/testing_utils.py)
    TrlTestCase, ignore_warnings, is_ampere_or_newer, require_ampere_or_newer, require_bitsandbytes, require_kernels,
    require_liger_kernel, require_peft, require_peft_target_parameters, require_torch_accelerator,
    require_torch_multi_accelerator, require_vision, require_vllm, xfail_data_parallel,
)
"""
CONFTEST = f"""import os
import sys

sys.path.insert(0, {str(BENCH)!r})
import trl_test_harness  # noqa: E402

TRAINER = os.environ.get("TRL_TRAINER", "sft")
trl_test_harness.install(swap=os.environ.get("TRL_SWAP") == "dist", trainer=TRAINER)
from trl_test_harness import lazy_shared_datadir, per_test_timeout  # noqa: E402,F401


def pytest_report_header(config):
    return "under test: " + trl_test_harness.trainer_under_test(TRAINER)
"""


def prepare(test_file: Path, work: Path, trainer: str) -> Path:
    """The test package and the stand-ins (built once per ``work`` folder)."""
    package = work / f"trl_{trainer}_suite"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "testing_utils.py").write_text(TESTING_UTILS)
    (package / "conftest.py").write_text(CONFTEST)
    shutil.copyfile(test_file, package / f"test_{trainer}_trainer.py")
    standins = Path(environment(work, swap=False)["TRL_STANDINS"])
    if not all((standins / path).exists() for path in (
            "hub/models--trl-internal-testing--tiny-Gemma2ForCausalLM", "data/toolcall/preference")):
        subprocess.run([sys.executable, str(BENCH / "trl_sft_standins.py"), str(standins)], check=True,
                       env=environment(work, swap=False))
    return package


def environment(work: Path, swap: bool) -> dict[str, str]:
    standins = work / ("standins-qwen-vocab" if os.environ.get("TRL_STANDINS_QWEN_VOCAB") == "1" else "standins")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRL_STANDINS=str(standins), HF_HUB_CACHE=str(standins / "hub"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("TRL_SWAP", None)
    if swap:
        env["TRL_SWAP"] = "dist"
    return env


def run(package: Path, work: Path, trainer: str, swap: bool, select: str | None) -> tuple[dict[str, str], dict]:
    """Test id -> passed / failed / error / skipped, from pytest's JUnit XML; and the trainers built, by class."""
    stem = f"{trainer}-{'dist' if swap else 'plain'}"
    report, built = work / f"{stem}.xml", work / f"{stem}.built"
    report.unlink(missing_ok=True)
    built.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", str(package / f"test_{trainer}_trainer.py"), "-q", "-p",
               "no:cacheprovider", f"--junitxml={report}", "--rootdir", str(work)]
    if select:
        command += ["-k", select]
    env = dict(environment(work, swap), TRL_TRAINER=trainer, TRL_BUILT_LOG=str(built))
    with open(work / f"{stem}.log", "w") as log:
        subprocess.run(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    if not report.exists():  # pytest stopped before collecting (e.g. the conftest failed): say where to look
        raise SystemExit(f"no test report from the {stem} run; see {work / f'{stem}.log'}")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        outcomes[case.get("name")] = outcome
    classes: dict[str, int] = {}
    for line in built.read_text().splitlines() if built.exists() else []:
        classes[line] = classes.get(line, 0) + 1
    return outcomes, classes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="TRL's tests/test_<trainer>_trainer.py")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="sft", help="which TRL trainer the file tests")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k selection")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl_fidelity"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test before it counts as failed")
    parser.add_argument("--qwen-vocab", action="store_true",
                        help="the Qwen2.5 stand-in with Qwen's vocabulary and special-token ids (slower)")
    args = parser.parse_args()
    os.environ["TRL_TEST_TIMEOUT"] = str(args.timeout)
    if args.qwen_vocab:
        os.environ["TRL_STANDINS_QWEN_VOCAB"] = "1"
    trl_name, dist_name = TRAINERS[args.trainer]
    package = prepare(args.test_file.resolve(), args.work, args.trainer)
    plain, plain_built = run(package, args.work, args.trainer, swap=False, select=args.select)
    dist, dist_built = run(package, args.work, args.trainer, swap=True, select=args.select)
    width = max(len(name) for name in plain | dist)
    print(f"{'test':<{width}}  {trl_name:<11}  {dist_name}")
    for name in sorted(plain | dist):
        print(f"{name:<{width}}  {plain.get(name, '-'):<11}  {dist.get(name, '-')}")
    for label, outcomes in ((trl_name, plain), (dist_name, dist)):
        counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "error", "skipped")}
        print(f"{label}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(outcomes)}")
    swap_broken = []
    for label, built, wrong in (("plain", plain_built, "hf_dist."), ("swapped", dist_built, "trl.")):
        print(f"trainers built in the {label} run (trainer class, arguments class: count):")
        for line, count in sorted(built.items()):
            print(f"  {line}: {count}")
            if line.split()[0].startswith(wrong):
                swap_broken.append(f"{label} run built {line.split()[0]}")
    for problem in swap_broken:
        print(f"SWAP NOT EFFECTIVE: {problem}")
    only_plain = sorted(n for n, o in plain.items() if o == "passed" and dist.get(n) != "passed")
    print(f"pass with {trl_name}, not with {dist_name}: {len(only_plain)}")
    for name in only_plain:
        print(f"  {name}  ({dist.get(name, 'missing')})")
    return 1 if only_plain or swap_broken else 0


if __name__ == "__main__":
    sys.exit(main())

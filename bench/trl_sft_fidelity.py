"""TRL's own SFT tests run twice, with ``SFTTrainer`` and with hf_dist's ``DistSFTTrainer``: a per-test table.

    python bench/trl_sft_fidelity.py PATH/TO/test_sft_trainer.py [-k EXPR] [--work DIR] [--timeout 300]
                                     [--qwen-vocab]

The test file is TRL's ``tests/test_sft_trainer.py`` for the installed trl, obtained by the user (nothing here
fetches it, and no TRL code is part of hf_dist). It is copied into a test package under ``--work`` whose
``testing_utils.py`` and ``conftest.py`` come from ``bench/trl_sft_standins.py``: offline stand-ins for the Hub
models and datasets the tests name, and, in the second run, ``trl.SFTTrainer`` replaced by
``hf_dist.trainer.sft.DistSFTTrainer`` before the test module imports it. Both runs are one process each
(``OMP_NUM_THREADS=1``, ``-p no:cacheprovider``, no ``-x``).

Prints every test's outcome in both runs, the counts, and the tests that pass with ``SFTTrainer`` and fail with
``DistSFTTrainer`` (exit status 1 when there is any). Not a test: it runs for minutes.
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
TESTING_UTILS = """from trl_sft_standins import (  # noqa: F401  (stand-in for TRL's tests/testing_utils.py)
    TrlTestCase, ignore_warnings, is_ampere_or_newer, require_bitsandbytes, require_kernels, require_liger_kernel,
    require_peft, require_peft_target_parameters, require_torch_accelerator, require_torch_multi_accelerator,
    require_vision, xfail_data_parallel,
)
"""
CONFTEST = f"""import os
import sys

sys.path.insert(0, {str(BENCH)!r})
import trl_sft_standins  # noqa: E402

trl_sft_standins.install(swap=os.environ.get("SFT_SWAP") == "dist")
from trl_sft_standins import lazy_shared_datadir, per_test_timeout  # noqa: E402,F401


def pytest_report_header(config):
    import trl

    return f"SFTTrainer under test: {{trl.SFTTrainer.__module__}}.{{trl.SFTTrainer.__qualname__}}"
"""


def prepare(test_file: Path, work: Path) -> Path:
    """The test package and the stand-ins (built once per ``work`` folder)."""
    package = work / "trl_sft_suite"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "testing_utils.py").write_text(TESTING_UTILS)
    (package / "conftest.py").write_text(CONFTEST)
    shutil.copyfile(test_file, package / "test_sft_trainer.py")
    standins = Path(environment(work, swap=False)["TRL_STANDINS"])
    if not (standins / "hub").is_dir():
        subprocess.run([sys.executable, str(BENCH / "trl_sft_standins.py"), str(standins)], check=True,
                       env=environment(work, swap=False))
    return package


def environment(work: Path, swap: bool) -> dict[str, str]:
    standins = work / ("standins-qwen-vocab" if os.environ.get("TRL_STANDINS_QWEN_VOCAB") == "1" else "standins")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRL_STANDINS=str(standins), HF_HUB_CACHE=str(standins / "hub"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("SFT_SWAP", None)
    if swap:
        env["SFT_SWAP"] = "dist"
    return env


def run(package: Path, work: Path, swap: bool, select: str | None) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped, from pytest's JUnit XML."""
    report = work / ("dist.xml" if swap else "plain.xml")
    command = [sys.executable, "-m", "pytest", str(package / "test_sft_trainer.py"), "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", "--rootdir", str(work)]
    if select:
        command += ["-k", select]
    with open(work / ("dist.log" if swap else "plain.log"), "w") as log:
        subprocess.run(command, cwd=work, env=environment(work, swap), stdout=log, stderr=subprocess.STDOUT)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        outcomes[case.get("name")] = outcome
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="TRL's tests/test_sft_trainer.py")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k selection")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl_sft_fidelity"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test before it counts as failed")
    parser.add_argument("--qwen-vocab", action="store_true",
                        help="the Qwen2.5 stand-in with Qwen's vocabulary and special-token ids (slower)")
    args = parser.parse_args()
    os.environ["SFT_TEST_TIMEOUT"] = str(args.timeout)
    if args.qwen_vocab:
        os.environ["TRL_STANDINS_QWEN_VOCAB"] = "1"
    package = prepare(args.test_file.resolve(), args.work)
    plain = run(package, args.work, swap=False, select=args.select)
    dist = run(package, args.work, swap=True, select=args.select)
    width = max(len(name) for name in plain | dist)
    print(f"{'test':<{width}}  {'SFTTrainer':<10}  DistSFTTrainer")
    for name in sorted(plain | dist):
        print(f"{name:<{width}}  {plain.get(name, '-'):<10}  {dist.get(name, '-')}")
    for label, outcomes in (("SFTTrainer", plain), ("DistSFTTrainer", dist)):
        counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "error", "skipped")}
        print(f"{label}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(outcomes)}")
    only_plain = sorted(n for n, o in plain.items() if o == "passed" and dist.get(n) != "passed")
    print(f"pass with SFTTrainer, not with DistSFTTrainer: {len(only_plain)}")
    for name in only_plain:
        print(f"  {name}  ({dist.get(name, 'missing')})")
    return 1 if only_plain else 0


if __name__ == "__main__":
    sys.exit(main())

"""transformers' own Trainer tests run twice, with ``Trainer`` and with ``DistTrainer`` swapped in: a per-file table.

    python bench/trainer_fidelity.py PATH/TO/tests/trainer [--files a.py b.py] [--skip a.py=why ...] [-k EXPR]
                                     [--work DIR] [--timeout 300] [--file-timeout 1800]

``PATH/TO/tests/trainer`` is transformers' ``tests/trainer`` folder, obtained by the user (the pip package has no
tests; nothing here fetches them, and no transformers test code is part of hf_dist). It is copied to
``WORK/tests/trainer`` (so its relative imports work) and each test file runs in its own pytest process, twice:

- as is (``Trainer``);
- swapped: this module is loaded as a pytest plugin (``-p trainer_fidelity``) which, before any test module is
  imported, rebinds ``transformers.Trainer``, ``transformers.trainer.Trainer``, ``transformers.TrainingArguments``
  and ``transformers.training_args.TrainingArguments`` to ``hf_dist``'s ``DistTrainer`` / ``DistTrainingArguments``.
  A test module's ``from transformers import Trainer`` (and ``trainer_test_utils``' ``get_regression_trainer``,
  its ``RegressionTrainingArguments`` subclass) then get hf_dist's classes. transformers' own subclasses
  (``Seq2SeqTrainer``) are imported first and keep the plain ``Trainer`` as their base.

The swap is checked, not assumed: in both runs every ``Trainer.__init__`` is counted per test, split by whether the
instance is an hf_dist class. The swapped run must construct no plain ``Trainer`` and the plain run no hf_dist one;
the totals are printed and a breach is an error (exit 2).

Both runs: one process per file, ``OMP_NUM_THREADS=1``, offline (``HF_HUB_OFFLINE=1``), no GPU,
``-p no:cacheprovider``, a per-test alarm (``--timeout``). The Hub models, tokenizers, datasets and the
``tests/fixtures/sample_text.txt`` the tests name are tiny stand-ins (``trainer_fidelity_standins``), the same in
both runs; a test needing anything else fails in both. Names a stored test file imports that the installed
transformers lacks get placeholders (``MISSING_NAMES``). Prints per file the passed / failed / error / skipped
counts of each run, the totals, and every test whose outcome differs; exit status 1 when a test passes with
``Trainer`` and not with ``DistTrainer``. Not a test: it runs for many minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SWAP_ENV = "TRAINER_FIDELITY_SWAP"  # "dist": the plugin swaps the classes in
STANDINS_ENV = "TRAINER_FIDELITY_STANDINS"  # the folder trainer_fidelity_standins wrote
RECORD_ENV = "TRAINER_FIDELITY_RECORD"  # where the plugin writes the per-test Trainer construction counts
TIMEOUT_ENV = "TRAINER_FIDELITY_TIMEOUT"
OUTCOMES = ("passed", "failed", "error", "skipped")


# ---- the pytest plugin (loaded in each pytest process with -p trainer_fidelity) -----------------------------------

_constructed: Counter = Counter()  # "dist" / "plain" Trainer.__init__ calls during the running test
_record: dict[str, dict[str, int]] = {}


def _count_constructions() -> None:
    """Count every ``Trainer.__init__``, split by whether the instance's class comes from hf_dist."""
    from transformers import trainer as trainer_module

    original = trainer_module.Trainer.__init__

    def counted(self, *args, **kwargs):
        from_hf_dist = any(c.__module__.split(".")[0] == "hf_dist" for c in type(self).__mro__)
        _constructed["dist" if from_hf_dist else "plain"] += 1
        return original(self, *args, **kwargs)

    trainer_module.Trainer.__init__ = counted


def _swap_in_dist_trainer(transformers) -> None:
    import transformers.trainer_seq2seq  # noqa: F401  (its Seq2SeqTrainer keeps the plain Trainer as base)

    from hf_dist import DistTrainer, DistTrainingArguments

    transformers.Trainer = transformers.trainer.Trainer = DistTrainer
    transformers.TrainingArguments = transformers.training_args.TrainingArguments = DistTrainingArguments


# Names some stored test files import from ``transformers`` that the installed version no longer has (used only by
# slow / Hub tests): placeholders that fail when used, so the rest of the file still collects. Same in both runs.
MISSING_NAMES = ("GlueDataset", "GlueDataTrainingArguments", "LineByLineTextDataset")


def _placeholders(transformers) -> None:
    for name in MISSING_NAMES:
        if not hasattr(transformers, name):
            def unavailable(*args, _name=name, **kwargs):
                raise RuntimeError(f"transformers {transformers.__version__} has no {_name} (trainer_fidelity)")

            setattr(transformers, name, type(name, (), {"__init__": unavailable}))


def _apply() -> None:
    """Placeholders and (swapped run) the swap, on the ``transformers`` module the test modules will import.

    Importing ``transformers.trainer`` replaces ``sys.modules["transformers"]`` by a new module object (transformers
    5.24's lazy module), so the submodules are imported first and the names set on the module object then current.
    """
    import transformers.trainer  # noqa: F401
    import transformers.training_args  # noqa: F401

    transformers = sys.modules["transformers"]
    _placeholders(transformers)
    if os.environ.get(SWAP_ENV) == "dist":
        _swap_in_dist_trainer(transformers)


def pytest_configure(config):
    if os.environ.get(RECORD_ENV) is None:
        return  # imported by something else than this bench's runs
    import trainer_fidelity_standins

    trainer_fidelity_standins.install(Path(os.environ[STANDINS_ENV]))
    _count_constructions()  # before the swap: it wraps the Trainer base class, which DistTrainer calls
    _apply()


def pytest_collectstart(collector):
    if os.environ.get(RECORD_ENV) is not None:
        _apply()  # idempotent: again in case an import replaced the module object since


def pytest_report_header(config):
    if os.environ.get(RECORD_ENV) is None:
        return None
    import transformers

    return f"Trainer under test: {transformers.Trainer.__module__}.{transformers.Trainer.__qualname__}"


def pytest_runtest_setup(item):
    if os.environ.get(RECORD_ENV) is None:
        return
    _constructed.clear()
    seconds = int(os.environ.get(TIMEOUT_ENV, "300"))

    def expire(signum, frame):
        raise TimeoutError(f"test ran past {seconds} s (harness timeout)")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


def pytest_runtest_teardown(item, nextitem):
    if os.environ.get(RECORD_ENV) is None:
        return
    signal.alarm(0)
    _record[item.nodeid] = dict(_constructed)


def pytest_unconfigure(config):
    if (path := os.environ.get(RECORD_ENV)) is not None:
        Path(path).write_text(json.dumps(_record))


# ---- the driver -------------------------------------------------------------------------------------------------

def environment(work: Path, swap: bool, record: Path, timeout: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", WANDB_DISABLED="true",
               PYTHONPATH=os.pathsep.join([str(BENCH), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env[RECORD_ENV] = str(record)
    env[STANDINS_ENV] = str(work / "standins")
    env["HF_HUB_CACHE"] = str(work / "standins" / "hub")
    env[TIMEOUT_ENV] = str(timeout)
    env.pop(SWAP_ENV, None)
    if swap:
        env[SWAP_ENV] = "dist"
    return env


def prepare(tests: Path, work: Path) -> Path:
    """``WORK/tests/trainer``: a copy of the given folder inside a ``tests`` package, and the stand-ins."""
    target = work / "tests" / "trainer"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(tests, target, ignore=shutil.ignore_patterns("__pycache__"))
    (work / "tests" / "__init__.py").write_text("")
    (target / "__init__.py").touch()
    standins = work / "standins"
    if not (standins / "hub").is_dir():
        subprocess.run([sys.executable, str(BENCH / "trainer_fidelity_standins.py"), str(standins)], check=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(BENCH), str(REPO)])))
    (work / "tests" / "fixtures").mkdir(exist_ok=True)
    shutil.copyfile(standins / "fixtures" / "sample_text.txt", work / "tests" / "fixtures" / "sample_text.txt")
    return target


def run_file(work: Path, name: str, swap: bool, select: str | None, timeout: int, file_timeout: int):
    """Test id -> (outcome, message), and test id -> Trainer constructions, for one file and one mode."""
    mode = "dist" if swap else "plain"
    stem = Path(name).stem
    report, record, log_path = (work / "out" / f"{stem}.{mode}.{ext}" for ext in ("xml", "json", "log"))
    report.parent.mkdir(exist_ok=True)
    for path in (report, record):
        path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", f"tests/trainer/{name}", "-q", "-p", "no:cacheprovider",
               "-p", "trainer_fidelity", f"--junitxml={report}", "--rootdir", str(work), "-o", "addopts="]
    if select:
        command += ["-k", select]
    with open(log_path, "w") as log:
        try:
            subprocess.run(command, cwd=work, env=environment(work, swap, record, timeout), stdout=log,
                           stderr=subprocess.STDOUT, timeout=file_timeout)
        except subprocess.TimeoutExpired:
            log.write(f"\n[trainer_fidelity] file ran past {file_timeout} s\n")
    if not report.exists():
        return {f"{stem}::<file>": ("error", f"no report (see {log_path})")}, {}
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "").splitlines()[0][:140] if child.get("message") else ""
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcomes[f"{stem}::{test_id}"] = (outcome, message)
    constructions = json.loads(record.read_text()) if record.exists() else {}
    return outcomes, constructions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="transformers' tests/trainer folder")
    parser.add_argument("--files", nargs="*", default=None, help="test files to run (default: every test_*.py)")
    parser.add_argument("--skip", nargs="*", default=[], metavar="FILE=REASON", help="files not run, and why")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k selection")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trainer_fidelity"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test before it counts as failed")
    parser.add_argument("--file-timeout", type=int, default=1800, help="seconds per file and mode")
    args = parser.parse_args()
    skipped_files = dict(entry.split("=", 1) for entry in args.skip)
    folder = prepare(args.tests.resolve(), args.work)
    files = args.files or sorted(p.name for p in folder.glob("test_*.py"))
    files = [name for name in files if name not in skipped_files]

    plain, dist, built = {}, {}, {"plain": Counter(), "dist": Counter()}
    for name in files:
        for swap, results in ((False, plain), (True, dist)):
            outcomes, constructions = run_file(args.work, name, swap, args.select, args.timeout, args.file_timeout)
            results.update(outcomes)
            for counts in constructions.values():
                built["dist" if swap else "plain"].update(counts)
        print(f"[{name}] done", file=sys.stderr, flush=True)

    def counts(results, stem):
        c = Counter(o for t, (o, _) in results.items() if t.startswith(f"{stem}::"))
        return "/".join(str(c[k]) for k in ("passed", "failed", "error", "skipped"))

    width = max([len(n) for n in files] + [4])
    print(f"{'file':<{width}}  {'Trainer p/f/e/s':>16}  {'DistTrainer p/f/e/s':>20}")
    for name in files:
        stem = Path(name).stem
        print(f"{name:<{width}}  {counts(plain, stem):>16}  {counts(dist, stem):>20}")
    for label, results in (("Trainer", plain), ("DistTrainer", dist)):
        c = Counter(o for o, _ in results.values())
        print(f"{label}: " + ", ".join(f"{c[k]} {k}" for k in OUTCOMES) + f" of {len(results)}")
    for name, reason in skipped_files.items():
        print(f"not run: {name} ({reason})")
    print(f"Trainer objects built: plain run {built['plain']['plain']} Trainer / {built['plain']['dist']} hf_dist; "
          f"swapped run {built['dist']['plain']} Trainer / {built['dist']['dist']} hf_dist")
    differ = sorted(t for t in plain.keys() | dist.keys()
                    if plain.get(t, ("missing",))[0] != dist.get(t, ("missing",))[0])
    print(f"outcome differs: {len(differ)}")
    for test in differ:
        p, d = plain.get(test, ("missing", "")), dist.get(test, ("missing", ""))
        print(f"  {test}: Trainer {p[0]}, DistTrainer {d[0]}  {d[1] or p[1]}")
    only_plain = [t for t in differ if plain.get(t, ("",))[0] == "passed"]
    print(f"pass with Trainer, not with DistTrainer: {len(only_plain)}")
    if built["dist"]["plain"] or built["plain"]["dist"] or not built["dist"]["dist"]:
        print("swap check FAILED: the swapped run built a plain Trainer, or none from hf_dist", file=sys.stderr)
        return 2
    return 1 if only_plain else 0


if __name__ == "__main__":
    sys.exit(main())

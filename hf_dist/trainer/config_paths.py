"""DeepSpeed JSON paths that work from any working directory, resolved before the Trainer reads them.

The shipped accelerate YAMLs name their DeepSpeed JSON relative to the repository root
(``deepspeed_config_file: ds_configs/zero3.json``), and accelerate opens that path relative to the working directory
of each launched process: launched from anywhere else, accelerate tried to decode the path as base64
(``UnicodeDecodeError``) and then refused a missing ``ds_configs/zero3.json``. Here a relative JSON path that is not
a file from the working directory is looked up in the repository holding hf_dist (where the shipped files live), and
anything still missing is a ``ValueError`` naming the value, where it was looked for and the fix.

Not here: generating the shipped files (``hf_dist.configs.ship``), reading the rest of the launcher's environment
(``hf_dist.trainer.launch_env``).
"""

from __future__ import annotations

import os
from pathlib import Path

DEEPSPEED_FILE_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
"""Where ``accelerate launch`` puts the YAML's ``deepspeed_config_file`` for each launched process."""
REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout holding this hf_dist: ``ds_configs/`` and ``accelerate_configs/`` sit next to ``hf_dist/``."""


def locate_json(value: str, source: str) -> str:
    """``value`` unchanged when it is a file from the working directory, else the repository's file of that relative
    path (absolute); ``source`` says where the value came from, for the error."""
    path = Path(value).expanduser()
    if path.is_file():
        return value
    shipped = REPO_ROOT / path
    if not path.is_absolute() and shipped.is_file():
        return str(shipped)
    looked = f"{Path.cwd() / path}" + ("" if path.is_absolute() else f" or {shipped}")
    raise ValueError(
        f"{source} names the DeepSpeed config {value!r}, which is not a file ({looked}); use an absolute path, a path "
        f"relative to the folder you launch from, or a shipped one (ds_configs/zero2.json, ds_configs/zero3.json, ...)"
    )


def anchor_deepspeed_paths(args) -> None:
    """Before ``TrainingArguments`` builds its DeepSpeed plugin: the launcher's JSON path (environment) and
    ``args.deepspeed`` point at an existing file. The environment is rewritten only when its value was not found
    from here, with the absolute path of the same file (every later reader, accelerate's included, then finds it)."""
    value = os.environ.get(DEEPSPEED_FILE_ENV)
    if value and value.lower().endswith(".json"):  # accelerate also takes base64 or a dict: those pass untouched
        found = locate_json(value, f"{DEEPSPEED_FILE_ENV}={value} (deepspeed_config_file in the accelerate config)")
        if found != value:
            os.environ[DEEPSPEED_FILE_ENV] = found
    deepspeed = getattr(args, "deepspeed", None)
    if isinstance(deepspeed, str) and deepspeed.lower().endswith(".json"):
        args.deepspeed = locate_json(deepspeed, f"--deepspeed {deepspeed}")

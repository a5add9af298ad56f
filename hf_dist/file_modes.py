"""Files hf_dist writes get the mode any file of the user's gets: 0o666 less the umask (0644 under umask 022).

safetensors' ``save_file`` (and so ``save_pretrained``) writes through a private temporary file and renames it,
leaving mode 0600: a model saved for a team, or a shared model cache, could be read by its owner only.
``save_safetensors`` is hf_dist's one writer of safetensors files; ``give_user_mode`` fixes what ``save_pretrained``
wrote. A leaf module (torch and the standard library only), so any folder may import it.

Not here: what to save (``hf_dist.checkpoint``, ``hf_dist.state_dict``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (async saves write from threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)  # elsewhere: the only portable read is a set and restore
    os.umask(umask)
    return umask


def user_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the umask (0o644 under umask 022)."""
    return 0o666 & ~current_umask()


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, then the mode a user's file gets (safetensors leaves 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, user_file_mode())


def give_user_mode(directory: str | os.PathLike) -> None:
    """The ``*.safetensors`` files directly in ``directory`` (written by ``save_pretrained``) get ``user_file_mode``."""
    mode = user_file_mode()
    for path in Path(directory).glob("*.safetensors"):
        if path.is_file() and path.stat().st_mode & 0o777 != mode:
            os.chmod(path, mode)

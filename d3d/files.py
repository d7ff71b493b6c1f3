"""Safetensors files as normal files: readable by others, like every file a user's umask makes.

safetensors' `save_file` writes through a private temporary file and renames it, so the weights
it writes are mode 0600 whatever the umask — an exported model another user or a serving engine
cannot read, beside a config.json that is 0644. `save_tensors` writes the same file, then gives it
the mode `open()` would have (0666 less the umask: 0644 under the usual 022). It decides nothing
about what is stored. `write_text` writes a small file whole or not at all.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def current_umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, the file then given a normal file's mode."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def write_text(path: Path, text: str) -> None:
    """`text` into `path` (its folder made if missing) through a temporary file renamed into place:
    a concurrent reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(text)
    os.replace(staging, path)

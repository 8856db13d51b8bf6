"""Shard checkpoints: written atomically (temporary file, fsync, rename, fsync of the folder), so
a crash at any moment leaves the last complete checkpoint readable; read back on restart."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def checkpoint_path(run_dir: str | Path, shard_index: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"shard-{shard_index}.pt"


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash only once the folder is on disk
    finally:
        os.close(fd)


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``, or None if there is none. Tensors and plain data only."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)

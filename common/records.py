"""Run records: JSON lines written as training goes, read back by the launcher and reports; the
run dirs that hold them, and files of theirs written whole (checkpoints, the trained model)."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from wavelet.common.security import aside_path


def save_whole(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` whole or not at all, and on disk when it returns:
    written aside, synced, renamed over ``path``, the folder synced."""
    _replace_whole(Path(path), lambda f: torch.save(obj, f))


def write_text_whole(path: Path, text: str, sync: bool = True) -> None:
    """``text`` to ``path`` whole or not at all (a reader never sees half of it), as
    ``save_whole`` does; ``sync=False``: not waiting for the disk (a file that tells other
    processes something now, such as a shard's address, need not outlive a crash)."""
    _replace_whole(Path(path), lambda f: f.write(text.encode()), sync)


def _replace_whole(path: Path, write: Callable[[BinaryIO], Any], sync: bool = True) -> None:
    # the aside file is this writer's own: two writers of one path (two workers started by
    # hand with one run dir both save its model.pt) each rename a whole file, the last wins
    tmp = aside_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if not sync:
        return
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash only once the folder is on disk
    finally:
        os.close(fd)


def new_run_dir(kind: str = "", root: str | Path = "runs") -> Path:
    """A new, empty run dir ``runs/[kind-]<date-time>``, made here for this run alone: runs
    started in the same second (two terminals, a script) get ``-2``, ``-3``, ... instead of
    sharing one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{kind}-{stamp}" if kind else stamp
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = Path(root) / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


class RecordWriter:
    """Appends one JSON object per line; thread-safe, flushed per record so readers see progress."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=_jsonable)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records in ``path``; a half-written last line (a writer still running) is skipped."""
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                yield json.loads(line)


def last_record(path: str | Path) -> dict[str, Any] | None:
    """The last complete record of ``path`` (None if there is no such file or record)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 65536))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    complete = tail.rsplit("\n", 1)[0] if not tail.endswith("\n") else tail
    for line in reversed(complete.splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue  # the first line of the tail may be cut
    return None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")

"""Shared-memory segments: files in ``/dev/shm`` mapped into a shard and a worker on one host.

Only tensor bytes travel through them; every control message (op, clock, versions, errors) still
goes over ZeroMQ. A shard creates each segment (mode 0600, an unguessable name under one prefix per
run and shard) and offers it with a nonce written into its first bytes: a client that can open the
file and reads the same nonce is on the same host as the same user, and uses it; any other client
stays on TCP. Files rather than ``multiprocessing.shared_memory``: on Python < 3.13 its resource
tracker unlinks a segment when any process that merely opened it exits.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path(os.environ.get("WAVELET_SHM_DIR", "/dev/shm"))
HEADER_BYTES = 64  # the nonce, then padding; chunks start 64-byte aligned after it
ALIGN = 64


def run_prefix(run_dir: str | Path) -> str:
    """The name prefix of every segment of one run: the launcher and a restarted shard remove
    what a killed shard left by it."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"wavelet-{digest}-"


def layout(nbytes: list[int]) -> tuple[list[int], int]:
    """Byte offset of each chunk in a segment, and the segment's size."""
    offsets, at = [], HEADER_BYTES
    for n in nbytes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


class Segment:
    """One mapped file. ``create`` makes it (0600, exclusive); ``open`` maps an existing one."""

    def __init__(self, path: Path, size: int, fd: int, owner: bool):
        self.path = path
        self.size = size
        self._fd = fd
        self.owner = owner
        self._map = mmap.mmap(fd, size)
        self._pinned_ptr: int | None = None
        self.nonce = ""

    @classmethod
    def create(cls, prefix: str, size: int, nonce: str = "") -> Segment:
        """A new segment with ``nonce`` (a fresh one if empty) written into its first bytes."""
        SHM_DIR.mkdir(mode=0o700, exist_ok=True)  # /dev/shm, or a folder WAVELET_SHM_DIR names
        path = SHM_DIR / f"{prefix}{secrets.token_hex(12)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            segment = cls(path, size, fd, owner=True)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        segment.nonce = nonce or secrets.token_hex(8)
        segment._map[: len(segment.nonce)] = segment.nonce.encode()
        return segment

    @classmethod
    def open(cls, name: str, size: int, nonce: str) -> Segment:
        """Map segment ``name``; raises OSError unless it is the one offered (same nonce)."""
        if "/" in name or not name:
            raise OSError(f"bad segment name {name!r}")
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"segment {name} is not {size} bytes")
            segment = cls(path, size, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise
        if bytes(segment._map[: len(nonce)]) != nonce.encode():
            segment.close()
            raise OSError(f"segment {name} is not the one offered (another host?)")
        segment.nonce = nonce
        return segment

    @property
    def name(self) -> str:
        return self.path.name

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over ``numel`` elements at byte ``offset``, sharing the segment's memory."""
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset)

    def pin(self) -> None:
        """Page-lock the segment for CUDA (cudaHostRegister), so device copies into and out of
        it are asynchronous and run at full bus speed; no-op without CUDA."""
        if self._pinned_ptr is not None or not torch.cuda.is_available():
            return
        view = self.tensor(0, self.size, torch.uint8)
        ptr = view.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
        if int(err) == 0:
            self._pinned_ptr = ptr

    def close(self) -> None:
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor still views it; the mapping goes with the last view
        os.close(self._fd)
        if self.owner:
            self.path.unlink(missing_ok=True)


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment under ``prefix`` that this user owns (left by a killed shard)."""
    removed = []
    if not prefix or not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            if path.stat().st_uid == os.getuid():
                path.unlink()
                removed.append(path.name)
        except OSError:
            continue
    return removed

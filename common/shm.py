"""Shared-memory segments: files in ``/dev/shm`` mapped into a shard and a worker on one host.

Only tensor bytes travel through them; every control message (op, clock, versions, errors) still
goes over ZeroMQ. A shard creates each segment (mode 0600, an unguessable name under one prefix per
run and shard) and offers it with a nonce written into its first bytes: a client that can open the
file and reads the same nonce is on the same host as the same user, and uses it; any other client
stays on TCP. Files rather than ``multiprocessing.shared_memory``: on Python < 3.13 its resource
tracker unlinks a segment when any process that merely opened it exits.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path(os.environ.get("WAVELET_SHM_DIR", "/dev/shm"))
HEADER_BYTES = 64  # the nonce, then padding; chunks start 64-byte aligned after it
ALIGN = 64
NONCE_CHARS = 16  # hex: 64 random bits
ANONYMOUS_NAME = "wavelet-wave"  # the memfd name of a wave's memory (``Segment.anonymous``)


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


class NoSpaceForSegments(OSError):
    """The shared-memory folder is too full for a wave's segments (TCP is used instead)."""


def free_bytes() -> int:
    """Bytes free in the shared-memory folder (0 if it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


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
            # Reserve every page now: a tmpfs that runs out later would kill whoever touches
            # the missing page with SIGBUS; here it is one ENOSPC, before anyone uses it.
            os.posix_fallocate(fd, 0, size)
            segment = cls(path, size, fd, owner=True)
        except BaseException as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise NoSpaceForSegments(
                    f"{SHM_DIR} has {free_bytes() / 1e6:.1f} MB free, too little for a "
                    f"{size / 1e6:.1f} MB segment: tensors travel over TCP instead (a Docker "
                    "container gets 64 MB unless run with a larger --shm-size)"
                ) from None
            raise
        segment._stamp(nonce or secrets.token_hex(NONCE_CHARS // 2))
        return segment

    @classmethod
    def anonymous(cls, size: int) -> Segment:
        """A segment no file in the shared-memory folder names (a memfd): its memory goes with
        the last process that maps it, even after kill -9, so there is nothing to clean up.
        Another process of this user on this host maps it by ``proc_open`` (its pid and fd)."""
        if not hasattr(os, "memfd_create"):
            raise OSError("this system has no memfd_create (Linux only)")
        fd = os.memfd_create(ANONYMOUS_NAME, os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)  # every page reserved now (see ``create``)
            segment = cls(Path(f"/proc/{os.getpid()}/fd/{fd}"), size, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise
        segment._stamp(secrets.token_hex(NONCE_CHARS // 2))
        return segment

    def _stamp(self, nonce: str) -> None:
        """Write ``nonce`` into the first bytes: a peer that reads it back opened this one."""
        self.nonce = nonce
        self._map[: len(nonce)] = nonce.encode()

    @property
    def fd(self) -> int:
        return self._fd

    @classmethod
    def proc_open(cls, pid: int, fd: int, size: int, nonce: str) -> Segment:
        """Map another process's ``anonymous`` segment; OSError unless it is the one offered.
        The offer comes from a peer: only a wave memory of this host, with its full random
        nonce, is ever mapped (never a file a peer names by guessing a pid and descriptor)."""
        if pid <= 0 or fd < 0 or len(nonce) < NONCE_CHARS:
            raise OSError(f"bad offer: process {pid}, descriptor {fd}, nonce {nonce!r}")
        path = Path(f"/proc/{pid}/fd/{fd}")
        if not os.readlink(path).startswith(f"/memfd:{ANONYMOUS_NAME} "):
            raise OSError(f"process {pid}'s descriptor {fd} is not a wave's memory")
        return cls._open(path, size, nonce)

    @classmethod
    def open(cls, name: str, size: int, nonce: str) -> Segment:
        """Map segment ``name``; raises OSError unless it is the one offered (same nonce)."""
        if "/" in name or not name:
            raise OSError(f"bad segment name {name!r}")
        return cls._open(SHM_DIR / name, size, nonce)

    @classmethod
    def _open(cls, path: Path, size: int, nonce: str) -> Segment:
        name = path.name
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
        if numel == 0:  # frombuffer refuses a count of 0: an empty tensor shares nothing
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset)

    def tensors(self, offsets: list[int], descs: list) -> list[torch.Tensor]:
        """A view per chunk: ``descs[i]`` (a ``TensorDesc``) at byte ``offsets[i]``; OSError
        where a chunk would reach past the segment (offsets a peer sent)."""
        if len(offsets) != len(descs):
            raise OSError(f"{len(offsets)} offsets laid out for {len(descs)} chunks")
        for i, (offset, desc) in enumerate(zip(offsets, descs, strict=True)):
            if offset < 0 or offset + desc.nbytes > self.size:
                raise OSError(
                    f"chunk {i} at byte {offset} does not fit the {self.size}-byte segment"
                )
        return [self.tensor(o, d.numel, d.torch_dtype) for o, d in zip(offsets, descs, strict=True)]

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


class SegmentsLock:
    """One shard's claim on its segment prefix, held for the shard's life: a second shard of the
    same run dir and index (started by hand) must not remove the live one's segments, and
    ``wavelet clean`` must prove a run dead before it removes what the run left. An ``flock``
    on a file in the run dir: the kernel drops it when the holder dies, even by SIGKILL."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock; False if a live process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        """The pid written by whoever holds (or last held) the lock, or "?"."""
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

"""Shard checkpoints: written atomically (temporary file, fsync, rename, fsync of the folder), so
a crash at any moment leaves the last complete checkpoint readable; read back on restart. The
``Checkpointer`` decides when, and counts what a restart lost."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from wavelet.common.daemon_config import PSConfig
from wavelet.common.protocol import ErrorCode, ProtocolError
from wavelet.common.records import RecordWriter, last_record, save_whole
from wavelet.ps.shard import Shard
from wavelet.ps.staleness import ClockTable, WaveId

log = logging.getLogger(__name__)


def checkpoint_path(run_dir: str | Path, shard_index: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"shard-{shard_index}.pt"


def write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_whole(state, path)


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``, or None if there is none. Tensors and plain data only."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


class Checkpointer:
    """When one shard checkpoints, what it restores at start, and what its restarts lost.

    Checkpoints hold the parameters, optimizer state, version and every wave's clock (an open
    bulk-synchronous sum is not an applied update and is not saved). The push log (one record per
    push, ``records/ps-<i>-pushes.jsonl``) says which version the last run reached, so a restore
    from an older checkpoint knows how many updates it lost."""

    def __init__(self, config: PSConfig, shard: Shard, clocks: ClockTable):
        self.config = config
        self.shard = shard
        self.clocks = clocks
        self.failures = 0
        self.seconds = 0.0  # how long the last checkpoint took
        self.ok_at = time.monotonic()  # when the last checkpoint succeeded (or the start)
        self.lost_on_restore = 0  # updates the last run applied that its checkpoint missed
        self.enabled = True  # a standby writes nothing until it takes its shard over
        self._last = (0, time.monotonic())  # version and time of the last attempt
        self.push_log: RecordWriter | None = None
        self.member_log: RecordWriter | None = None
        if config.run_dir:
            # a standby that takes its shard over records beside the primary's records, in its
            # own file (a run dir a launcher shares, a cluster benchmark merges)
            role = "-takeover" if config.standby_role else ""
            records = Path(config.run_dir) / "records"
            self.push_log = RecordWriter(records / f"ps-{config.shard_index}{role}-pushes.jsonl")
            self.member_log = RecordWriter(records / f"ps-{config.shard_index}{role}-members.jsonl")

    def log_membership(self, kind: str, wave: tuple[str, int], why: str) -> None:
        """A wave joined or left (the records' timeline marks them)."""
        if self.member_log and self.enabled:
            self.member_log.write(
                {"t": time.time(), "event": kind, "wave": f"{wave[0]}/{wave[1]}", "why": why}
            )

    def log_push(self, **record) -> None:
        """One push, as the shard decided it (the last record tells a restore what was lost)."""
        if self.push_log and self.enabled:
            self.push_log.write({"t": time.time(), **record})

    @property
    def path(self) -> Path:
        return checkpoint_path(self.config.run_dir, self.config.shard_index)

    def restore(self) -> list[tuple[WaveId, int]]:
        """Load the last checkpoint into the shard, if any; returns the waves' clocks it held."""
        if not self.config.run_dir:
            return []
        logged = last_record(self.push_log.path) if self.push_log else None
        last_version = int(logged.get("version", 0)) if logged else 0
        state = read_checkpoint(self.path)
        if state is None:
            self.lost_on_restore = last_version
            return []
        self.shard.load_state_dict(state)
        self._last = (self.shard.version, time.monotonic())
        self.lost_on_restore = max(0, last_version - self.shard.version)
        log.warning(
            "shard %d restored version %d from its checkpoint (%d update(s) after it were lost)",
            self.config.shard_index,
            self.shard.version,
            self.lost_on_restore,
        )
        return [((worker, wave), clock) for worker, wave, clock in state["clocks"]]

    def write(self) -> Path:
        """A checkpoint now (an admin request, the periodic timer, the final one)."""
        if not self.config.run_dir:
            raise ProtocolError(ErrorCode.MALFORMED, "this shard was started without a run dir")
        if not self.shard.initialized:
            raise ProtocolError(ErrorCode.NOT_INITIALIZED, "nothing to checkpoint yet")
        started = time.monotonic()
        state = self.shard.state_dict()
        state["clocks"] = [[w[0], w[1], c] for w, c in self.clocks.clocks.items()]
        write_checkpoint(self.path, state)
        self._last = (self.shard.version, time.monotonic())
        self.ok_at = self._last[1]
        self.seconds = self.ok_at - started
        return self.path

    def maybe(self) -> None:
        """Checkpoint when due (every N updates and/or S seconds); a failure is counted and
        retried at the next interval, never raised."""
        cfg = self.config
        if not (cfg.run_dir and self.shard.initialized and self.enabled):
            return
        version, when = self._last
        due_updates = cfg.checkpoint_every and self.shard.version - version >= cfg.checkpoint_every
        due_time = cfg.checkpoint_every_s and time.monotonic() - when >= cfg.checkpoint_every_s
        if not ((due_updates or due_time) and self.shard.version != version):
            return
        try:
            self.write()
        except Exception as e:  # disk full, permissions: keep serving, try at the next interval
            self.failures += 1
            self._last = (self.shard.version, time.monotonic())
            log.error(
                "checkpoint at version %d failed (%s: %s); still serving, retrying at the "
                "next interval",
                self.shard.version,
                type(e).__name__,
                e,
            )

    def maybe_final(self) -> None:
        """A checkpoint now, where there is a run dir and something to save; a failure is
        logged, never raised (the shard is handing itself over or stopping)."""
        try:
            if self.config.run_dir and self.shard.initialized and self.enabled:
                self.write()
        except Exception as e:
            log.error("checkpoint failed: %s: %s", type(e).__name__, e)

    def close(self) -> None:
        """The final checkpoint (when there is something to save); then the push log closes,
        whatever the checkpoint raised."""
        try:
            self.maybe_final()
        finally:
            for log_file in (self.push_log, self.member_log):
                if log_file:
                    log_file.close()

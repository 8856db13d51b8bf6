"""Which connection owns each wave: a wave's name is not a credential.

A wave is bound to the connection that registered it (its ROUTER peer identity, and with CURVE the
client's authenticated public key). Requests that name the wave from any other connection are
refused and change nothing. The binding ends when that connection closes (the transport reports
it), when the wave leaves or is dropped for silence, and with the shard process: a restarted
shard knows no connections, so every wave registers again before it pushes or pulls. A wave that
really reconnects (a restarted worker, a new TCP connection) therefore re-joins with one
``register``, while another process that merely names the wave cannot take it over.
"""

from __future__ import annotations

from dataclasses import dataclass

from wavelet.common.protocol import ErrorCode, ProtocolError, wave_name
from wavelet.ps.staleness import WaveId


@dataclass(frozen=True)
class Peer:
    """One client connection: its ROUTER identity and, with CURVE, its public key (z85)."""

    identity: bytes
    key: str = ""


class WaveOwners:
    def __init__(self) -> None:
        self._owner: dict[WaveId, Peer] = {}
        self._keys: dict[WaveId, str] = {}  # with CURVE: the key a wave registered with, kept

    def claim(self, wave: WaveId, peer: Peer) -> None:
        """Bind ``wave`` to ``peer`` (a register); refused while another connection owns it,
        and with CURVE, for a different key than the wave's first one."""
        owner = self._owner.get(wave)
        if owner is not None and owner.identity != peer.identity:
            raise ProtocolError(
                ErrorCode.WAVE_IN_USE,
                f"wave {wave_name(*wave)} is registered by another connection that is still "
                "open; a restarted worker re-joins once the old one is gone (closed, or silent "
                "past wave_timeout_s)",
            )
        if self._keys.get(wave, peer.key) != peer.key:
            raise ProtocolError(
                ErrorCode.WAVE_IN_USE,
                f"wave {wave_name(*wave)} belongs to another client key",
            )
        self._owner[wave] = peer
        if peer.key:
            self._keys[wave] = peer.key

    def check(self, wave: WaveId, peer: Peer) -> None:
        """Raise unless ``peer`` owns ``wave`` (NOT_REGISTERED when nobody does: register)."""
        owner = self._owner.get(wave)
        if owner is None:
            raise ProtocolError(
                ErrorCode.NOT_REGISTERED,
                f"wave {wave_name(*wave)} has no registered connection here (the shard "
                "restarted, the wave was dropped, or its connection changed): register again",
            )
        if owner.identity != peer.identity:
            raise ProtocolError(
                ErrorCode.WAVE_IN_USE,
                f"wave {wave_name(*wave)} is registered by another connection; requests naming "
                "it from this one are refused",
            )

    def owned_by(self, wave: WaveId, peer: Peer) -> bool:
        owner = self._owner.get(wave)
        return owner is not None and owner.identity == peer.identity

    def bound(self, wave: WaveId) -> bool:
        return wave in self._owner

    def release(self, wave: WaveId) -> None:
        """The wave left or was dropped: its next connection may claim it."""
        self._owner.pop(wave, None)

    def forget(self, wave: WaveId) -> None:
        self._owner.pop(wave, None)
        self._keys.pop(wave, None)

    def connection_closed(self, identity: bytes) -> list[WaveId]:
        """Release the waves of a closed connection; returns them."""
        gone = [w for w, p in self._owner.items() if p.identity == identity]
        for wave in gone:
            del self._owner[wave]
        return gone

    def waves_of(self, identity: bytes) -> list[WaveId]:
        return [w for w, p in self._owner.items() if p.identity == identity]

"""Who may checkpoint or stop a shard: the holder of the run's admin token, or with CURVE and an
admin key, only the client that authenticated with that key (a token can be read by anyone who
reads torchrun's store; an authenticated key cannot)."""

from __future__ import annotations

import hmac

from wavelet.common.protocol import ErrorCode, ProtocolError
from wavelet.ps.owners import Peer


class AdminGate:
    def __init__(self, token: str = "", key: str = ""):
        self._token = token
        self._key = key  # z85 public key, as CURVE reports the sender

    def check(self, op: str, peer: Peer, token: str) -> None:
        """Raise ``unauthorized`` unless ``peer`` (sending ``token``) may run ``op``."""
        if self._key:
            if not hmac.compare_digest(peer.key.encode(), self._key.encode()):
                raise ProtocolError(
                    ErrorCode.UNAUTHORIZED,
                    f"{op} is taken only from the admin client key (--curve-admin-key)",
                )
            return
        if not self._token:
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"{op} is disabled: this shard has no admin token (start it with --run-dir "
                "or --admin-token-file); stop it with SIGTERM instead",
            )
        if not hmac.compare_digest(token.encode(), self._token.encode()):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"{op} needs the shard's admin token (the run dir's admin.token)",
            )

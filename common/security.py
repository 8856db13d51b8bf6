"""ZeroMQ CURVE: authentication and encryption between waves and shards.

``wavelet keys`` writes key pairs (``NAME.key`` public, ``NAME.key_secret`` secret, in ZeroMQ's
certificate format). A shard holds the server's secret key and a folder of the public keys of
the clients it accepts; a client holds its own secret key and the server's public key. A client
whose key is not in the folder never completes the handshake, so it can neither pull nor push.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket as pysocket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from wavelet.common.settings import ConfigError

log = logging.getLogger(__name__)


def generate_keys(folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write a key pair; returns (public key file, secret key file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(folder), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


@dataclass(frozen=True)
class JobKeys:
    """Key files for one launched job: the shards' pair, and one pair per client."""

    folder: Path

    @property
    def server_secret(self) -> Path:
        return self.folder / "server" / "server.key_secret"

    @property
    def server_public(self) -> Path:
        return self.folder / "server" / "server.key"

    @property
    def authorized(self) -> Path:
        return self.folder / "authorized"

    def client_secret(self, name: str) -> Path:
        return self.folder / "clients" / f"{name}.key_secret"

    def client_public(self, name: str) -> Path:
        return self.folder / "clients" / f"{name}.key"

    @classmethod
    def create(cls, folder: Path, clients: list[str]) -> JobKeys:
        keys = cls(folder)
        generate_keys(folder / "server", "server")
        keys.authorized.mkdir(parents=True, exist_ok=True)
        for name in clients:
            public, _ = generate_keys(folder / "clients", name)
            (keys.authorized / public.name).write_bytes(public.read_bytes())
        return keys

    def client(self, name: str) -> ClientKeys:
        return ClientKeys.load(str(self.client_secret(name)), str(self.server_public))


def _load(path: str | Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE key {path}: {e}") from None
    if secret and secret_key is None:
        raise ConfigError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret_key


def public_key_z85(path: str | Path) -> str:
    """The public key in a key file, as CURVE reports an authenticated client (z85 text)."""
    public, _ = _load(path, secret=False)
    return public.decode()


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs: its own key pair and the shards' public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, secret_file: str, server_public_file: str) -> ClientKeys:
        public, secret = _load(secret_file, secret=True)
        server_public, _ = _load(server_public_file, secret=False)
        return cls(public, secret, server_public)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public


class ServerSecurity:
    """CURVE on a shard's ROUTER socket; only clients whose public key is in ``authorized``."""

    def __init__(self, context: zmq.Context, secret_file: str, authorized: str):
        self.public, self.secret = _load(secret_file, secret=True)
        if not Path(authorized).is_dir():
            raise ConfigError(f"authorized keys folder {authorized} does not exist")
        self.auth = ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(authorized))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()


def is_loopback(address: str) -> bool:
    """True for ipc:// and inproc:// addresses and tcp:// on a loopback host."""
    if not address.startswith("tcp://"):
        return True
    host = urlsplit(address).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:  # a host name: loopback only if every address it names is
        infos = pysocket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(address: str, secure: bool, insecure: bool) -> None:
    """Refuse to listen beyond this machine unencrypted unless the user said so explicitly."""
    if secure or is_loopback(address):
        return
    if not insecure:
        raise ConfigError(
            f"{address} is reachable from other machines: secure it with CURVE (wavelet launch "
            "--curve; for wavelet ps, --curve-secret and --curve-authorized from `wavelet keys`) "
            "or pass --insecure"
        )
    log.warning(
        "listening on %s without authentication or encryption (--insecure): anyone "
        "who can reach it can read and change the model",
        address,
    )


# --- the admin token ------------------------------------------------------------------------------
# checkpoint and shutdown change a shard's life, so they need a secret that only the user who
# started the job can read: a random token in the run dir, mode 0600, made by whichever of the
# launcher or the shards comes first.

ADMIN_TOKEN_FILE = "admin.token"


def admin_token_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / ADMIN_TOKEN_FILE


def _new_private_file(path: Path, text: str) -> None:
    """Create ``path`` (0600) holding ``text``; fails if anything, a link included, is there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def aside_path(path: Path) -> Path:
    """A new name beside ``path`` for this writer alone (its pid and a random token), to write
    a file whole before it is renamed or linked to ``path``: two writers never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_private(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by this user only (mode 0600), replacing what is
    there: written to a new file first and renamed over it, so neither an existing file's mode
    nor a symlink at ``path`` is ever followed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = aside_path(path)
    _new_private_file(tmp, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_private(path: Path) -> None:
    """Refuse a secret file that other users can read or that another user owns."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{path} can be read by other users (mode {st.st_mode & 0o777:o}): chmod 600 {path}"
        )
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to another user; use a token file of your own")


def load_admin_token(path: str | Path, create: bool = True) -> str:
    """The token in ``path``; with ``create``, a new one is written there first if none is."""
    path = Path(path)
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = aside_path(path)
        _new_private_file(tmp, secrets.token_hex(32))
        try:
            os.link(tmp, path)  # atomic, and never replaces a token another process wrote
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        check_private(path)
        token = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the admin token {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"the admin token file {path} is empty")
    return token

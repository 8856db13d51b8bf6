"""Connecting to shards: a DEALER socket (CURVE when keys are given), a worker's client keys,
and one request outside any wave (``wavelet stats``, shutdown, checkpoint)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from wavelet.common.protocol import (
    Header,
    Op,
    ShardTimeout,
    decode_reply,
    raise_for_error,
    send_message,
)
from wavelet.common.security import ClientKeys


def dealer(
    context: zmq.Context,
    keys: ClientKeys | None = None,
    options: dict[int, int] | None = None,
) -> zmq.Socket:
    """A DEALER, not yet connected (CURVE-secured when ``keys`` are given), closing with linger
    0; ``options`` are extra socket options, ZeroMQ constant -> value."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    if keys is not None:
        keys.apply(sock)
    return sock


def connect_dealer(
    context: zmq.Context,
    address: str,
    keys: ClientKeys | None = None,
    options: dict[int, int] | None = None,
) -> zmq.Socket:
    """A DEALER connected to ``address`` (see ``dealer``)."""
    sock = dealer(context, keys, options)
    sock.connect(address)
    return sock


def wait_for_addresses(
    files: list[str], timeout_s: float, stop: threading.Event | None = None
) -> list[str] | None:
    """The addresses starting shards write to ``files`` (atomically, once bound), in order;
    None if ``stop`` is set first. Raises ShardTimeout naming the first file still missing."""
    deadline = time.monotonic() + timeout_s
    for name in files:
        path = Path(name)
        while not path.exists():
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise ShardTimeout(
                    f"no shard wrote its address to {path} within {timeout_s:.0f} s: is that "
                    "shard running? its log says why not"
                )
            time.sleep(0.05)
    return [Path(name).read_text().strip() for name in files]


def client_keys(config) -> ClientKeys | None:
    """The CURVE keys a WorkerConfig names, if any."""
    if not getattr(config, "curve_secret", ""):
        return None
    return ClientKeys.load(config.curve_secret, config.curve_server_key)


def call_shard(
    address: str,
    op: Op,
    timeout_s: float = 5.0,
    context: zmq.Context | None = None,
    keys: ClientKeys | None = None,
    **fields,
) -> Header:
    """One request to one shard outside any wave (stats, shutdown, checkpoint); raises a
    ``ShardError`` on an error reply or when the shard does not answer within ``timeout_s``."""
    context = context or zmq.Context.instance()
    sock = connect_dealer(context, address, keys, {zmq.SNDTIMEO: int(timeout_s * 1000)})
    try:
        try:
            send_message(sock, Header(op=op, request_id=1, **fields))
        except zmq.Again:
            raise ShardTimeout(
                f"could not send {op} to shard {address} within {timeout_s:.0f}s", [address]
            ) from None
        if not sock.poll(timeout_s * 1000):
            raise ShardTimeout(
                f"shard {address} did not answer {op} within {timeout_s:.0f}s", [address]
            )
        h, _ = decode_reply(sock.recv_multipart(copy=False), address)
        raise_for_error(h, address)
        return h
    finally:
        sock.close(linger=0)

"""Length-prefixed frames over TCP: what every tandem control connection carries (msgpack
payloads, never pickle). A closed connection surfaces as `PeerGone` at once."""

from __future__ import annotations

import hmac
import socket
import struct

_HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (for a rendezvous another process will bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PeerGone(ConnectionError):
    """The other end closed the connection (its process exited or crashed)."""


def same_token(given, expected: str) -> bool:
    """Whether a peer's first frame carried our secret: constant time, and never raises (the
    peer may be anyone, ``given`` any msgpack value)."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(frame(data))


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerGone("connection closed")
        buf += chunk
    return bytes(buf)

"""Length-prefixed frames over TCP: what every tandem control connection carries (one
`tandem.wire.Codec` message each). A closed connection surfaces as `PeerGone` at once.

Every listener authenticates the same way: a peer's first frame is the shared token alone, at
most `TOKEN_FRAME_MAX` bytes, compared in constant time (`check_token`), so a stranger who can
reach a port can make the listener hold no more than that. After it, a frame may be up to
`MAX_FRAME` bytes, and its buffer grows with the bytes that arrive, never ahead of them: a
header that announces a large frame allocates nothing by itself.
"""

from __future__ import annotations

import hmac
import socket
import struct

_HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30  # the largest frame an authenticated peer may send
TOKEN_FRAME_MAX = 256  # the most a peer may send before it has proved the token
RECV_CHUNK = 1 << 20  # a frame's buffer grows by at most this much per read
MAX_HELLO = 4096  # a worker's or trainer's hello after the token: its rank and pid


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (for a rendezvous another process will bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PeerGone(ConnectionError):
    """The other end closed the connection (its process exited or crashed)."""


def frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(frame(data))


def recv_frame(sock: socket.socket, max_size: int = MAX_FRAME) -> bytes:
    """The next frame's payload; ValueError if its header announces more than ``max_size``."""
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if size > max_size:
        raise ValueError(f"frame of {size} bytes exceeds {max_size}")
    return _recv_exactly(sock, size)


def send_token(sock: socket.socket, token: str) -> None:
    """The first frame of every authenticated connection: the listener's token, alone."""
    send_frame(sock, token.encode())


def check_token(sock: socket.socket, token: str, timeout: float) -> bool:
    """Whether the peer's first frame is ``token`` (constant time). Reads at most
    `TOKEN_FRAME_MAX` bytes and waits at most ``timeout`` seconds; never raises (the peer may
    be anyone, sending anything)."""
    sock.settimeout(timeout)
    try:
        given = recv_frame(sock, TOKEN_FRAME_MAX)
    except (OSError, ValueError):  # PeerGone is an OSError
        return False
    return hmac.compare_digest(given, token.encode())


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), RECV_CHUNK))
        if not chunk:
            raise PeerGone("connection closed")
        buf += chunk
    return bytes(buf)

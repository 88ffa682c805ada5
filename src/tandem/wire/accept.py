"""Authenticated accept, the one way every tandem listener takes a peer (the engine's worker
control channel, the exchange server, the RL demo's trainers): the peer's first frame is the
token alone (`check_token`: small, constant time), its second its hello, decoded by the
listener's codec within a size cap and required to be the expected message type. Anyone else's
connection is closed having made the listener read no more than that."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from tandem.wire.codec import Codec
from tandem.wire.frames import MAX_HELLO, check_token, recv_frame


def read_hello(
    sock: socket.socket,
    token: str,
    codec: Codec,
    hello_type: type,
    timeout: float,
    max_size: int = MAX_HELLO,
):
    """The hello of the peer on ``sock`` once it proved ``token``: a ``hello_type`` message of
    at most ``max_size`` bytes, each frame within ``timeout`` seconds (the socket then blocks
    without a timeout). None, and the connection closed, for anyone else."""
    if check_token(sock, token, timeout):
        try:
            hello = codec.decode(recv_frame(sock, max_size))
        except (OSError, ValueError):  # gone, silent, or not a frame of this codec
            hello = None
        if isinstance(hello, hello_type):
            sock.settimeout(None)
            return hello
    sock.close()
    return None


def accept_hello(
    listener: socket.socket,
    token: str,
    codec: Codec,
    hello_type: type,
    timeout: float,
    max_size: int = MAX_HELLO,
):
    """(socket, hello) of one connection from ``listener`` (`read_hello`), or None: nobody
    connected within the listener's own timeout, or the peer was not one of ours."""
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        return None
    hello = read_hello(sock, token, codec, hello_type, timeout, max_size)
    return None if hello is None else (sock, hello)


def gather_hellos(
    listener: socket.socket,
    token: str,
    codec: Codec,
    hello_type: type,
    world: int,
    deadline: float,
    check_alive: Callable[[], None],
    timeout: float,
) -> dict[int, tuple[socket.socket, object]]:
    """(socket, hello) of ranks ``0 .. world - 1``, each the first to say hello with its
    ``rank`` (a hello naming another rank, or one already taken, is closed), accepted until
    ``deadline`` (`time.monotonic`; then TimeoutError naming the missing ranks).
    ``check_alive`` runs between accepts and raises if a rank's process died (the sockets
    accepted so far are closed then)."""
    listener.settimeout(0.5)
    peers: dict[int, tuple[socket.socket, object]] = {}
    try:
        while len(peers) < world:
            check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(peers))
                raise TimeoutError(f"ranks {missing} did not connect in time")
            if (peer := accept_hello(listener, token, codec, hello_type, timeout)) is None:
                continue  # nobody, or not one of ours
            sock, hello = peer
            if hello.rank not in range(world) or hello.rank in peers:
                sock.close()
                continue
            peers[hello.rank] = peer
    except BaseException:
        for sock, _ in peers.values():
            sock.close()
        raise
    return peers

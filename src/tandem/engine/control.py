"""The control channel between the engine core and its workers: `CONTROL` messages in
length-prefixed frames over TCP (`tandem.wire`, no pickle). Data flows down as step messages
and back as results; a closed connection means the worker is gone, which the engine notices at
once."""

from __future__ import annotations

import selectors
import socket

from tandem.engine.messages import CONTROL, Failure, Hello, Message
from tandem.wire import PeerGone, frame, gather_hellos, recv_frame, send_frame, send_token

__all__ = ["ControlServer", "PeerGone", "connect", "recv", "send"]


def send(sock: socket.socket, msg: Message) -> None:
    send_frame(sock, CONTROL.encode(msg))


HELLO_TIMEOUT_S = 10.0  # a connection that has not proved the token by then is dropped


def recv(sock: socket.socket, max_size: int | None = None) -> Message:
    return CONTROL.decode(recv_frame(sock) if max_size is None else recv_frame(sock, max_size))


def connect(host: str, port: int, token: str, hello: Hello, timeout: float = 60.0) -> socket.socket:
    """A worker's control connection: the engine's token first, then its hello."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_token(sock, token)
    send(sock, hello)
    return sock


class ControlServer:
    """The engine side: one connection per worker rank, authenticated by a shared token."""

    def __init__(self, host: str, token: str, world_size: int):
        self.token = token
        self.world_size = world_size
        self.listener = socket.create_server((host, 0))
        self.address = self.listener.getsockname()[:2]
        self.peers: dict[int, socket.socket] = {}
        self.pids: dict[int, int] = {}
        self._selector = selectors.DefaultSelector()

    def accept_all(self, deadline: float, check_alive) -> None:
        """Wait until every rank has connected; ``check_alive`` raises if a local worker died."""
        try:
            peers = gather_hellos(
                self.listener,
                self.token,
                CONTROL,
                Hello,
                self.world_size,
                deadline,
                check_alive,
                HELLO_TIMEOUT_S,
            )
        except TimeoutError as exc:
            raise TimeoutError(f"worker {exc}") from None
        for rank, (sock, hello) in sorted(peers.items()):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peers[rank] = sock
            self.pids[rank] = hello.pid
            self._selector.register(sock, selectors.EVENT_READ, rank)
        self.listener.close()

    def broadcast(self, msg: Message) -> None:
        data = frame(CONTROL.encode(msg))
        for rank, sock in self.peers.items():
            try:
                sock.sendall(data)
            except OSError as exc:
                raise PeerGone(f"worker rank {rank} is gone ({exc})") from None

    def send_to(self, rank: int, msg: Message) -> None:
        try:
            send(self.peers[rank], msg)
        except OSError as exc:
            raise PeerGone(f"worker rank {rank} is gone ({exc})") from None

    def receive(self, timeout: float) -> tuple[int, Message] | None:
        """The next frame from any worker, or None after ``timeout`` seconds.
        Raises PeerGone naming the rank whose connection closed."""
        for key, _ in self._selector.select(timeout):
            rank = key.data
            try:
                msg = recv(key.fileobj)
            except (PeerGone, OSError):
                raise PeerGone(f"worker rank {rank} (pid {self.pids[rank]}) exited") from None
            if isinstance(msg, Failure):
                raise PeerGone(f"worker rank {msg.rank} failed: {msg.error}")
            return rank, msg
        return None

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self._selector.close()
        self.listener.close()

"""The wire every tandem control connection uses: length-prefixed frames over TCP (`frames`),
a token first on every connection, then a hello (`accept`), carrying typed messages in one
msgpack codec (`codec`, never pickle). Weight bytes never travel here: transports move them
(the one tensor that does is what a worker answers to `LLM.score`, as raw float32 bytes)."""

from tandem.wire.accept import accept_hello, gather_hellos, read_hello
from tandem.wire.codec import Codec
from tandem.wire.frames import (
    MAX_FRAME,
    MAX_HELLO,
    TOKEN_FRAME_MAX,
    PeerGone,
    check_token,
    frame,
    free_port,
    recv_frame,
    send_frame,
    send_token,
)

__all__ = [
    "MAX_FRAME",
    "MAX_HELLO",
    "TOKEN_FRAME_MAX",
    "Codec",
    "PeerGone",
    "accept_hello",
    "check_token",
    "frame",
    "free_port",
    "gather_hellos",
    "read_hello",
    "recv_frame",
    "send_frame",
    "send_token",
]

"""The one wire layer: the codec encodes typed dataclasses (nested, enums, tuples, optionals)
by their declared fields and refuses anything else as ValueError; `gather_hellos` takes one
authenticated hello per rank. (Token-first and flood handling:
tests/integration/server/test_security.py.)"""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import msgpack
import pytest

from support.paths import SRC
from tandem.wire import Codec, frame, gather_hellos, send_frame, send_token

TEST = Codec("test")


class Color(Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class Box:
    slices: tuple[tuple[int, int], ...]
    flipped: bool = False


@TEST.register("shape")
@dataclass(slots=True)
class Shape:
    rank: int
    scale: float
    box: Box
    boxes: list[Box]
    maybe: Box | None
    color: Color
    sizes: dict[str, tuple[int, ...]]
    routed: list[list[list[int]] | None] | None
    handle: list | None = None  # plain data of any shape
    pair: tuple[int, str] = (1, "x")
    ids: list[int] = field(default_factory=list)


@TEST.register("hello")
@dataclass(slots=True)
class Hello:
    rank: int
    pid: int


@TEST.register("stop")
@dataclass(slots=True)
class Stop:
    pass


def shape() -> Shape:
    boxes = [Box(((1, 2),)), Box(())]
    return Shape(
        3,
        2,
        Box(((0, 3), (1, 2)), True),
        boxes,
        None,
        Color.BLUE,
        {"w": (3, 4)},
        [[[1, 2]], None],
        [1, ["x", b"y"]],
        (5, "y"),
        [1, 2, 3],
    )


def test_typed_values_round_trip_as_themselves():
    for msg in (shape(), Hello(1, 2), Stop()):
        assert TEST.decode(TEST.encode(msg)) == msg
    back = TEST.decode(TEST.encode(shape()))
    assert back.color is Color.BLUE and type(back.box.slices[0]) is tuple
    assert back.sizes["w"] == (3, 4) and back.pair == (5, "y")
    many = Shape(
        0,
        0.5,
        Box(()),
        [Box(((i, i + 1),), i % 2 == 0) for i in range(50)],
        Box(((0, 1),)),
        Color.RED,
        {},
        None,
    )
    assert TEST.decode(TEST.encode(many)) == many


def test_fields_travel_in_declared_order_with_the_kind_first():
    assert msgpack.unpackb(TEST.encode(Hello(4, 7))) == ["hello", 4, 7]
    wire = msgpack.unpackb(TEST.encode(shape()))
    assert wire[:4] == ["shape", 3, 2, [[[0, 3], [1, 2]], True]] and wire[6] == "blue"


def good() -> list:
    return msgpack.unpackb(TEST.encode(shape()))


def changed(index: int, value) -> bytes:
    wire = good()
    wire[index] = value
    return msgpack.packb(wire)


MALFORMED = [
    msgpack.packb(1),
    msgpack.packb([]),
    msgpack.packb(["nope", 1]),
    msgpack.packb([["hello"], 1]),
    msgpack.packb(["hello", 1]),
    msgpack.packb(["hello", 1, 2, 3]),
    msgpack.packb(["stop", 1]),
    msgpack.packb(["hello", "1", 2]),
    msgpack.packb(["hello", True, 2]),
    msgpack.packb({"a": 1}),
    msgpack.packb(["hello", 1.5, 2]),
    b"\xc1",
    b"",
    "ключ".encode(),
    b"\x93\xa5hello\x01",
    changed(1, None),
    changed(3, [[[0, 3]]]),
    changed(3, [[[0, 3, 4]], True]),
    changed(3, "box"),
    changed(4, [[[0, 1]], True, 5]),
    changed(4, [1]),
    changed(5, [1]),
    changed(6, "green"),
    changed(6, ["red"]),
    changed(7, {"w": "34"}),
    changed(7, {1: [3]}),
    changed(8, "x"),
    changed(10, [1, "x", 3]),
    changed(10, [1, 2]),
    changed(11, None),
    msgpack.packb(["hello", msgpack.ExtType(1, b"x"), 2]),
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_frames_raise_value_error(data):
    with pytest.raises(ValueError, match="^malformed test "):
        TEST.decode(data)


def test_random_bytes_never_raise_anything_but_value_error():
    rng = random.Random(0)
    base = TEST.encode(shape())
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            TEST.decode(bytes(data))
        except ValueError:
            pass


def test_a_field_names_the_field_that_is_wrong():
    with pytest.raises(ValueError, match=r"Hello\.pid: unexpected str"):
        TEST.decode(msgpack.packb(["hello", 1, "2"]))
    with pytest.raises(ValueError, match="Hello has 2 fields, got 3"):
        TEST.decode(msgpack.packb(["hello", 1, 2, 3]))


def test_only_registered_dataclasses_are_messages():
    with pytest.raises(TypeError, match="not a test message: Box"):
        TEST.encode(Box(()))
    with pytest.raises(ValueError, match="registered twice"):
        TEST.register("hello")(Box)


def test_no_message_is_encoded_by_hand():
    """One codec: nothing in the package packs msgpack or writes to_wire/from_wire beside it."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        text = path.read_text()
        if "def to_wire" in text or "def from_wire" in text:
            found.append(f"{rel}: to_wire/from_wire")
        if ("msgpack.packb" in text or "msgpack.unpackb" in text) and rel.parts[0] != "wire":
            if rel != Path("exchange/plan.py"):  # a layout's fingerprint, hashed, never sent
                found.append(f"{rel}: msgpack")
    assert not found, found


def test_gather_hellos_takes_one_hello_per_rank_and_names_the_missing():
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = listener.getsockname()[:2]
    clients = []

    def connect(first: bytes, hello) -> None:
        sock = socket.create_connection((host, port))
        clients.append(sock)
        sock.sendall(first)
        send_frame(sock, TEST.encode(hello))

    def peers():
        connect(frame(b"tok"), Hello(5, 1))  # no such rank
        connect(frame(b"tok"), Stop())  # not a hello
        connect(frame(b"bad"), Hello(0, 1))  # wrong token
        for rank in (1, 1, 0):  # rank 1 twice: the second is dropped
            sock = socket.create_connection((host, port))
            clients.append(sock)
            send_token(sock, "tok")
            send_frame(sock, TEST.encode(Hello(rank, 100 + len(clients))))

    thread = threading.Thread(target=peers)
    thread.start()
    try:
        got = gather_hellos(
            listener, "tok", TEST, Hello, 2, time.monotonic() + 30, lambda: None, 10
        )
        assert sorted(got) == [0, 1] and got[1][1].pid == 104 and got[0][1].pid == 106
        for sock, _ in got.values():
            assert sock.gettimeout() is None
            sock.close()
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1, 2\] did not connect"):
            gather_hellos(listener, "tok", TEST, Hello, 3, time.monotonic() + 1, lambda: None, 1)
    finally:
        thread.join(30)
        for sock in clients:
            sock.close()
        listener.close()

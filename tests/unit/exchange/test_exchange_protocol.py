"""The exchange's typed messages: settings checked by field, nested types round-trip the one
codec (`tandem.wire.Codec`) as themselves."""

import msgpack
import pytest

from tandem.engine.messages import CONTROL, ApplyResult, ApplyWeights, Capacity
from tandem.exchange.items import Record, SendItem
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import PUSH, PushHello, PushPlan, PushReady
from tandem.exchange.quantize import Quantized
from tandem.exchange.settings import GroupInfo, PushPhase, PushSettings, UpdateSpec
from tandem.exchange.transports import TRANSPORTS, check
from tandem.exchange.transports.base import ReceiverHalf, SenderHalf
from tandem.layers.placement import LocalRegion, Piece


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"transport": "rdma"}, "transport"),
        ({"transport": "shm", "mode": "eager"}, "mode"),
        ({"transport": "cuda_ipc", "mode": "in_place"}, "mode"),
        ({"transport": "shm", "verify": "yes"}, "verify"),
    ],
)
def test_push_settings_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        check(PushSettings(**kwargs))


def test_every_registered_transport_has_both_halves():
    for name, t in TRANSPORTS.items():
        assert t.name == name and "staged" in t.modes
        assert issubclass(t.receiver, ReceiverHalf)
        # broadcast: vLLM's protocol, whose trainers broadcast themselves (no WeightSender)
        assert issubclass(t.sender, SenderHalf) if name != "broadcast" else t.sender is None


def test_weight_sender_refuses_the_broadcast_transport():
    with pytest.raises(ValueError, match="^transport must be one of .*'shm'.*got 'broadcast'"):
        check(PushSettings("broadcast"))


def layout() -> RankLayout:
    out = RankLayout(1, dtype="bfloat16", arena=[7, 3, 99, 4096, [["w", 0, [4, 8]]]])
    out.add(
        "model.qkv",
        (6, 8),
        [
            Piece("q", (4, 8), ((0, 4), (0, 8)), (0, 0)),
            Piece("k", (2, 8), ((0, 2), (0, 8)), (4, 0), True),
        ],
    )
    return out


def test_messages_round_trip_with_their_named_types():
    region = LocalRegion(((2, 5), (0, 8)), transposed=True)
    item = SendItem(
        "w",
        region,
        (3, 8),
        96,
        96,
        1,
        "model.w",
        LocalRegion(((0, 3), (0, 8))),
        "bfloat16",
        "model.w",
        (2, 0),
    )
    settings = PushSettings("dist", "in_place", False)
    group = GroupInfo("h", 1, "p", 4, "gloo")
    for msg in (
        PushHello(0, 2, None, layout(), ["v_head"], settings),
        PushPlan(
            "bfloat16",
            96,
            [item],
            group=group,
            trainers=2,
            quantize=[Quantized("model.w", (64, 64), (16, 16))],
        ),
        PushReady([123, None], [96, 0], None),
    ):
        back = PUSH.decode(PUSH.encode(msg))
        assert back == msg
    assert type(back.crcs) is list
    plan = PushPlan("float32", 0, [], quantize=[Quantized("model.w", (64, 64), (16, 16))])
    assert PUSH.decode(PUSH.encode(plan)).quantize[0].block == (16, 16)  # a tuple again
    hello = PUSH.decode(PUSH.encode(PushHello(0, 2, None, layout(), [], settings)))
    assert hello.layout.local_shapes == {"model.qkv": (6, 8)}  # tuples again, not lists
    assert hello.layout.regions[1].piece.box == ((0, 2), (0, 8)) and hello.settings == settings
    record = Record(1, 96, 96, "model.w", region, (3, 8), "float8_e4m3fn", crc=7)
    spec = UpdateSpec(3, settings, "float32", 2, staging=([1, 2, 3, 4], None), group=group)
    apply = CONTROL.decode(CONTROL.encode(ApplyWeights(PushPhase.COMMIT, spec, [record] * 3)))
    assert apply == ApplyWeights(PushPhase.COMMIT, spec, [record] * 3)
    assert apply.update.group == group and apply.records[2].region.slices == ((2, 5), (0, 8))
    capacity = CONTROL.decode(CONTROL.encode(Capacity(1, 10, layout())))
    assert capacity.layout == layout()


def test_a_hello_with_untyped_settings_is_malformed():
    hello = PUSH.encode(PushHello(0, 1, None, RankLayout(0), [], PushSettings("shm")))
    bad = hello.replace(b"\xa6staged", b"\xa6eager!")  # a mode no transport has
    with pytest.raises(ValueError, match="malformed exchange hello message: mode must be"):
        PUSH.decode(bad)
    unknown = PUSH.decode(hello.replace(b"\xa3shm", b"\xa3xyz"))  # the exchange server's check
    with pytest.raises(ValueError, match="transport must be one of"):
        check(unknown.settings)
    old_wire = [
        "hello",
        0,
        1,
        None,
        [0, "float32", [], [], None],
        [],
        ["shm", "staged", True],
        False,
        "off",
        None,
        None,
    ]
    with pytest.raises(ValueError, match="RankLayout"):  # a layout as positional lists
        PUSH.decode(msgpack.packb(old_wire))


def test_weight_sender_layout_is_checked_and_auto_reads_plain_modules_by_hf_names():
    import torch

    from tandem.exchange import WeightSender

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="^layout must be one of"):
        WeightSender(model, "127.0.0.1:1/token", layout="deepspeed")
    assert WeightSender(model, "127.0.0.1:1/token").layout == "hf"


def test_push_phases_are_a_type_on_the_engine_control_channel():
    """A phase crosses to every engine rank as a `PushPhase`; one no rank knows cannot be
    expressed, and a frame that spells one is refused when it is decoded."""
    spec = UpdateSpec(3, PushSettings("shm"), "float32", 1)
    for phase in PushPhase:
        msg = ApplyWeights(phase, spec, [])
        back = CONTROL.decode(CONTROL.encode(msg))
        assert back == msg and back.phase is phase
        result = CONTROL.decode(CONTROL.encode(ApplyResult(1, phase, None, 8)))
        assert result.phase is phase
    wire = msgpack.unpackb(CONTROL.encode(ApplyWeights(PushPhase.COMMIT, spec, [])))
    wire[1] = "reboot"
    with pytest.raises(ValueError, match="'reboot' is not a valid PushPhase"):
        CONTROL.decode(msgpack.packb(wire))

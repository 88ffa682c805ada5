"""The exchange's typed messages: settings checked by field, named types round-trip msgpack."""

import pytest

from tandem.exchange.items import Record, SendItem
from tandem.exchange.protocol import PushHello, PushPlan, PushReady, decode, encode
from tandem.exchange.settings import PushSettings, UpdateSpec
from tandem.exchange.transports import TRANSPORTS
from tandem.exchange.transports.base import ReceiverHalf, SenderHalf
from tandem.layers.placement import LocalRegion


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"transport": "rdma"}, "transport"), ({"transport": "shm", "mode": "eager"}, "mode"),
     ({"transport": "cuda_ipc", "mode": "in_place"}, "mode"),
     ({"transport": "shm", "verify": "yes"}, "verify")],
)  # fmt: skip
def test_push_settings_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        PushSettings(**kwargs)


def test_every_registered_transport_has_both_halves():
    for name, t in TRANSPORTS.items():
        assert t.name == name and "staged" in t.modes
        assert issubclass(t.sender, SenderHalf) and issubclass(t.receiver, ReceiverHalf)


def test_messages_round_trip_with_their_named_types():
    region = LocalRegion(((2, 5), (0, 8)), transposed=True)
    item = SendItem("w", region, (3, 8), 96, 96, 1, "model.w", LocalRegion(((0, 3), (0, 8))))
    settings = PushSettings("dist", "in_place", False)
    for msg in (
        PushHello(0, 2, None, [0, "float32", [], [], None], ["v_head"], settings),
        PushPlan("bfloat16", 96, [item], group=["h", 1, "p", 4, "gloo"], trainers=2),
        PushReady([123, None], [96, 0], None),
    ):
        assert decode(encode(msg)) == msg
    record = Record(1, 96, 96, "model.w", region, (3, 8), crc=7)
    assert Record.from_wire(record.to_wire()) == record
    spec = UpdateSpec(3, settings, "float32", 2, staging=None, group=("h", 1, "p", 4, "gloo"))
    assert UpdateSpec.from_wire(spec.to_wire()) == spec


def test_a_hello_with_untyped_settings_is_malformed():
    bad = encode(PushHello(0, 1, None, [], [], PushSettings("shm")))
    bad = bad.replace(b"\xa3shm", b"\xa3xyz")  # an unknown transport on the wire
    with pytest.raises(ValueError, match="malformed hello"):
        decode(bad)


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
    import msgpack

    from tandem.engine.messages import ApplyResult, ApplyWeights
    from tandem.engine.messages import decode as decode_control
    from tandem.engine.messages import encode as encode_control
    from tandem.exchange.settings import PushPhase

    spec = UpdateSpec(3, PushSettings("shm"), "float32", 1)
    for phase in PushPhase:
        msg = ApplyWeights(phase, spec.to_wire(), [])
        back = decode_control(encode_control(msg))
        assert back == msg and back.phase is phase
        result = decode_control(encode_control(ApplyResult(1, phase, None, 8)))
        assert result.phase is phase
    with pytest.raises(ValueError, match="'reboot' is not a valid PushPhase"):
        decode_control(msgpack.packb(["apply", "reboot", spec.to_wire(), []]))

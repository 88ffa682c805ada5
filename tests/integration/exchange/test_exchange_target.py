"""The exchange talks to a declared `WeightTarget`: the engine implements it, and an exchange
server pushes into a fake target that has nothing else (so it touches nothing else)."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tandem import LLM
from tandem.engine.engine_target import EngineTarget
from tandem.exchange import (
    ExchangeAddress,
    UpdateWindow,
    WeightSender,
    WeightSyncError,
    WeightTarget,
)
from tandem.exchange.adapters.dtensor import dtensor_layout
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import PushPlan
from tandem.exchange.receiver import RankReceiver
from tandem.exchange.server import ExchangeServer, target_here
from tandem.exchange.settings import MODES, PushPhase, PushSettings, UpdateSpec
from tandem.exchange.transports import TRANSPORTS

pytestmark = pytest.mark.timeout(120)

PROTOCOL = {name for name in vars(WeightTarget) if not name.startswith("_")}


def test_the_protocol_names_no_engine_internals():
    assert PROTOCOL == {
        "weight_version",
        "weight_base",
        "weight_dtype",
        "weight_device_type",
        "receivers_in_process",
        "update_listeners",
        "weight_layouts",
        "weight_update",
        "unavailable",
        "refuses",
    }


def test_the_engine_is_a_weight_target(llama_dir):
    assert all(
        hasattr(EngineTarget, name) for name in PROTOCOL - {"weight_version", "update_listeners"}
    )
    with LLM(llama_dir) as llm:
        engine = llm.engine.target
        assert isinstance(engine, WeightTarget)
        assert engine.weight_dtype == "float32" and engine.weight_device_type == "cpu"
        assert engine.receivers_in_process and engine.unavailable() is None
        assert [lay.rank for lay in engine.weight_layouts()] == [0]
        assert target_here(ExchangeAddress.parse(llm.exchange_address)) is engine


class _Tiny(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(11, 4)
        self.proj = nn.Linear(4, 6)


class _Window:
    def __init__(self, target, spec):
        self.spec = spec
        self._target = target
        self._moved = 0

    def expose(self) -> None:
        self._target._phases.append("expose")

    def run(self, phase, records_by_rank) -> int:
        self._target._phases.append(phase)
        error, nbytes = self._target._receiver.handle(phase, self.spec, records_by_rank.get(0, []))
        if error is not None:
            raise WeightSyncError(error)
        self._moved = self._moved or nbytes
        return nbytes

    def ingress(self):
        return {0: (self._moved, 0.0)}

    def failures(self):
        return {}


class _FakeTarget:
    """A `WeightTarget` and nothing more: one receiving rank holding a plain module. Every
    public name the exchange reads is recorded."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._receiver = RankReceiver(model, 0, torch.device("cpu"))
        self._phases: list[PushPhase] = []
        self._read: set[str] = set()
        self.weight_version = 0
        self.update_listeners = [lambda *done: self._phases.append(done)]

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "_read").add(name)
        return object.__getattribute__(self, name)

    weight_dtype = "float32"
    weight_device_type = "cpu"
    receivers_in_process = True
    weight_base = None  # it does not track where its weights came from: pushes go dense

    def weight_layouts(self):
        return [dtensor_layout(self._model, 0)]

    @contextmanager
    def weight_update(self, spec):
        window = _Window(self, spec)
        try:
            yield window
        except BaseException:
            self._receiver.handle(PushPhase.ABORT, spec, [])
            raise
        self.weight_version = spec.version

    def unavailable(self):
        return None

    def refuses(self, settings):
        return None


@pytest.mark.parametrize(
    ("transport", "mode"), [("shm", "staged"), ("dist", "staged"), ("dist", "in_place")]
)
def test_a_server_pushes_into_a_target_that_is_only_the_protocol(transport, mode):
    live, trainer = _Tiny(0), _Tiny(1)
    before = {n: p.data_ptr() for n, p in live.named_parameters()}
    target = _FakeTarget(live)
    assert isinstance(target, WeightTarget)
    server = ExchangeServer(target)
    try:
        sender = WeightSender(trainer, server.address, transport=transport, mode=mode)
        stats = sender.push(version=3)
        sender.close()
    finally:
        server.close()
    assert stats.version == target.weight_version == 3 and stats.bytes_moved > 0
    assert [(r.replica, r.bytes_in, r.bytes_needed) for r in stats.replicas] == [
        (0, stats.bytes_needed, stats.bytes_needed)
    ]
    for (name, got), want in zip(live.named_parameters(), trainer.parameters(), strict=True):
        assert torch.equal(got, want) and got.data_ptr() == before[name]
    receive = [PushPhase.RECEIVE] if TRANSPORTS[transport].engine_receives else []
    expose = ["expose"] if mode == "in_place" else []
    assert target._phases[:-1] == [*expose, *receive, PushPhase.VERIFY, PushPhase.COMMIT]
    assert target._phases[-1][0] == 3 and target._phases[-1][2] is None  # listeners told
    assert target._read <= PROTOCOL, target._read - PROTOCOL


def test_a_window_is_an_update_window():
    assert isinstance(_Window(None, None), UpdateWindow)


def test_exchange_address_parses_and_formats_its_one_string_form():
    address = ExchangeAddress.parse("10.0.0.7:4242/abc123")
    assert address == ExchangeAddress("10.0.0.7", 4242, "abc123")
    assert str(address) == "10.0.0.7:4242/abc123"
    assert ExchangeAddress.parse("::1:80/t").host == "::1"
    for bad in ("10.0.0.7:4242", "10.0.0.7/abc", ":4242/abc", "h:port/abc", "h:1/"):
        with pytest.raises(ValueError, match=f"not an exchange address.*{bad!r}"):
            ExchangeAddress.parse(bad)
    with pytest.raises(ValueError, match="not an exchange address"):
        WeightSender(nn.Linear(2, 2), "nohost/abc")


def test_transports_say_what_sets_them_apart():
    for t in TRANSPORTS.values():
        assert set(t.modes) <= set(MODES) and t.device_types
    # the receiving ranks take part in moving the bytes (broadcast: vLLM's protocol)
    pausing = [n for n, t in TRANSPORTS.items() if t.pauses_to_deliver(PushSettings(n))]
    assert pausing == ["dist", "broadcast"]
    assert [n for n, t in TRANSPORTS.items() if "cpu" not in t.device_types] == ["cuda_ipc"]
    receivers = [RankLayout(0, arena=["arena of rank 0"]), RankLayout(1)]
    in_place = UpdateSpec(1, PushSettings("shm", "in_place"), "float32", 2)
    plans = [PushPlan("float32", 0, []), PushPlan("float32", 0, [])]
    shm = TRANSPORTS["shm"].coordinator("127.0.0.1", 5.0)
    with pytest.raises(ValueError, match=r"ranks \[1\] have none"):
        shm.prepare(in_place, plans, receivers, "cpu")
    receivers[1].arena = ["arena of rank 1"]
    assert shm.prepare(in_place, plans, receivers, "cpu") == in_place
    assert plans[1].arenas == [["arena of rank 0"], ["arena of rank 1"]]
    dist = TRANSPORTS["dist"].coordinator("127.0.0.1", 5.0)
    spec = dist.prepare(UpdateSpec(1, PushSettings("dist"), "float32", 2), plans, receivers, "cpu")
    group = spec.group
    assert (group.prefix, group.world, group.backend) == ("exchange/1", 4, "gloo")
    assert plans[0].group == group
    assert plans[1].trainers == 2 and plans[1].bucket_bytes == spec.bucket_bytes > 0
    dist.retire()  # a failed push: the next one rendezvouses in a new group
    again = dist.prepare(spec, plans, receivers, "cuda")
    assert (again.group.prefix, again.group.backend) == ("exchange/2", "nccl")


def test_a_target_nothing_adapts_is_refused_by_name():
    """Not an address, no ``exchange_address``, no integration's adapter takes it."""
    with pytest.raises(TypeError, match="cannot push into a dict: give an LLM"):
        WeightSender(_Tiny(0), {"exchange": "nowhere"})


def test_a_target_without_adapter_slots_refuses_an_adapter_push_and_keeps_its_weights():
    """A LoRA adapter's push needs an `AdapterTarget` (an engine with enable_lora); a target
    that only has the `WeightTarget` members refuses it before any byte moves."""
    from tandem.exchange import AdapterTarget

    live = _Tiny(0)
    before = {n: p.clone() for n, p in live.named_parameters()}
    target = _FakeTarget(live)
    assert not isinstance(target, AdapterTarget)
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    adapter = {
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(4, 2),
    }
    server = ExchangeServer(target)
    try:
        sender = WeightSender(adapter, server.address, lora_name="policy", lora_config=config)
        with pytest.raises(WeightSyncError, match="_FakeTarget takes no LoRA adapter pushes"):
            sender.push(version=1)
        sender.close()
    finally:
        server.close()
    assert all(torch.equal(p, before[n]) for n, p in live.named_parameters())
    assert target.weight_version == 0

"""A fleet of ``vllm serve`` replicas behind ``tandem router``: three real vLLM CPU servers (one
worker each, tandem's worker extension and middleware, the router's admin key), one real
router process, real HTTP. Requests spread over the replicas and equal transformers; the
router's ``/fleet_state`` names each replica's weight version; one push through the router's
URL updates every vLLM server (the trainer sending each byte once, relayed server to server
over dist), after which each generates what transformers does on the pushed weights; a push
vLLM cannot take (in place) is refused before any byte moves, naming why; a rolling push under
load commits wave by wave under vLLM's own pause, every call answered and naming the weight
versions it ran on (one version's tokens, or, under ``keep``, both named), none sent to a
server behind the version rolled out (the router's ``--max-staleness 0``); a server killed
mid-rollout is held out while the others commit, and once restarted on its checkpoint heals
from a vLLM peer. Last, one server alone: a trainer finds its exchange through ``GET
/admin/weights`` (admin key) and pushes into it directly; its completions then equal
transformers on the trainer's weights.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there). The servers and the
router are started once for the module.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

from support.routers import Router  # noqa: E402
from support.vllm_models import MODEL, moved  # noqa: E402
from support.vllm_serving import assert_serves, completion, vllm_serves  # noqa: E402
from support.waits import until  # noqa: E402
from tandem.exchange import WeightSender, WeightSyncError  # noqa: E402
from tandem.exchange.discovery import DiscoveryError  # noqa: E402
from tandem.fleet.window_messages import MEDIA_TYPE, WINDOW, CloseWindow  # noqa: E402

pytestmark = pytest.mark.timeout(600)

KEY = "tandem-test-admin-key"
REPLICAS = 3


@pytest.fixture(scope="module")
def fleet(model_factory, tmp_path_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    logs = [tmp_path_factory.mktemp("fleet") / f"vllm-{i}.log" for i in range(REPLICAS)]
    extension = (
        "--worker-extension-cls",
        "tandem.integrations.vllm.worker.TandemWorkerExtension",
        "--middleware",
        "tandem.integrations.vllm.serve.exchange",
    )
    with vllm_serves(model_dir, logs, *extension, env={"TANDEM_ADMIN_KEY": KEY}) as servers:
        urls = [s.url for s in servers]
        # no request goes to a replica behind the version being rolled out
        router = Router(*urls, extra=("--admin-key", KEY, "--max-staleness", "0"))
        try:
            until("the router sees every replica", lambda: _health(router)["status"] == "ok", 60)
            yield router, urls, model_dir, servers
        finally:
            router.stop()


def _health(router) -> dict:
    return router.client.get("/health").json()


def _weights_version(url: str) -> int:
    request = urllib.request.Request(
        url + "/admin/weights", headers={"authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())["version"]


def test_requests_spread_over_the_vllm_replicas_and_equal_transformers(fleet):
    router, urls, model_dir, _ = fleet
    state = router.client.get("/fleet_state").json()
    assert [(s["url"], s["engine"], s["state"]) for s in state] == [
        (url, "vllm", "serving") for url in urls
    ]
    before = [r["requests"] for r in _health(router)["replicas"]]
    # the checkpoint the servers loaded (this module's first test: nothing pushed yet)
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for k in range(6):  # different prompts: the router spreads what no replica has cached
        prompt = [7 + k, 40 + 3 * k, 11, 90 + k, 2]
        tokens, _, _ = completion(router.url, prompt)
        with torch.no_grad():
            logits = start(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
    after = [r["requests"] for r in _health(router)["replicas"]]
    routed = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(routed) == 6 and sum(1 for n in routed if n) >= 2, routed


@pytest.mark.parametrize(("transport", "seed"), [("dist", 3), ("shm", 4)])
def test_one_push_through_the_router_updates_every_vllm_replica(fleet, transport, seed):
    router, urls, model_dir, _ = fleet
    model = moved(model_dir, seed)
    sender = WeightSender(model, router.url, admin_key=KEY, transport=transport)
    try:
        stats = sender.push()
    finally:
        sender.close()
    assert stats.bytes_moved == stats.bytes_needed  # the trainer sent one copy (counted)
    assert [(r.replica, r.state) for r in stats.replicas] == [
        (r, "committed") for r in range(REPLICAS)
    ]
    assert [r.bytes_in for r in stats.replicas] == [stats.bytes_needed] * REPLICAS
    if transport == "dist":  # relayed replica to replica: each passes on what the next needs
        assert sum(r.bytes_relayed for r in stats.replicas) == (REPLICAS - 1) * stats.bytes_needed
    assert [_weights_version(url) for url in urls] == [stats.version] * REPLICAS
    state = router.client.get("/fleet_state").json()
    assert [(s["state"], s["version"]) for s in state] == [("serving", stats.version)] * REPLICAS
    for url in urls:  # each vLLM server now generates what transformers does on those weights
        assert_serves(url, model)


def test_a_push_in_place_is_refused_before_any_byte_moves(fleet):
    router, urls, model_dir, _ = fleet
    versions = [_weights_version(url) for url in urls]
    sender = WeightSender(moved(model_dir, 5), router.url, admin_key=KEY, mode="in_place")
    try:
        with pytest.raises(WeightSyncError, match="in_place"):  # vLLM keeps repacked weights
            sender.push(policy="rolling")
    finally:
        sender.close()
    assert [_weights_version(url) for url in urls] == versions
    assert _health(router)["status"] == "ok"


@pytest.mark.parametrize("wave", ["wait", "keep"])
def test_a_rolling_push_under_load_updates_the_vllm_replicas_wave_by_wave(fleet, wave):
    """Clients call through the router throughout a rolling push: every call is answered, the
    replicas commit one wave at a time and each then serves the new weights. ``wait``: a
    wave's requests finish first (the router sends it none, and vLLM's pause waits for any
    running), so each greedy completion is transformers' on the old weights or on the new
    ones, never a mix, and names that version. ``keep``: vLLM's pause freezes a wave's
    running requests across its commit; vLLM reports no per-token version, so a completion
    that crossed it names both. Once the push is held everywhere, no call goes to a server
    behind it (``--max-staleness 0``): each names the new version."""
    router, urls, model_dir, _ = fleet
    old, new = moved(model_dir, 7), moved(model_dir, 8)
    trainer = moved(model_dir, 7)
    sender = WeightSender(trainer, router.url, admin_key=KEY, transport="shm")
    load = Load(router.url)
    try:
        before = sender.push()  # the weights the replicas serve when the rollout begins
        trainer.load_state_dict(new.state_dict())  # the trainer's step
        load.start()
        start = len(load.answers)
        stats = sender.push(policy="rolling", max_unavailable=1, wave=wave)
        held = time.monotonic()  # every replica holds the new version: none older is routed to
        done = stats.wait(timeout=300)
        during = len(load.answers)
        load.stop()
    finally:
        load.stop()
        sender.close()
    answers = load.answers
    assert not load.errors, load.errors[:3]
    assert during > start  # calls were answered while the replicas rolled
    state = router.client.get("/fleet_state").json()
    assert done.committed == list(range(REPLICAS)), [(s["state"], s.get("reason")) for s in state]
    assert stats.version == before.version + 1
    assert [_weights_version(url) for url in urls] == [stats.version] * REPLICAS
    want = {tuple(p): [_greedy(m, p) for m in (old, new)] for p in Load.PROMPTS}
    by_version = {before.version: 0, stats.version: 1}
    for (prompt, tokens), call in zip(answers, load.calls, strict=True):
        # every answer names the weights it ran on: one version's tokens, or both named
        assert set(call.versions) <= set(by_version), call
        if len(call.versions) == 1:
            assert tokens == want[tuple(prompt)][by_version[call.versions[0]]], (prompt, call)
        else:
            assert wave == "keep", call  # "wait": a wave's requests end before its commit
        if call.began > held:  # max_staleness 0: only replicas on the new version
            assert call.versions == [stats.version], call
    assert any(t == want[tuple(p)][1] for p, t in answers[during:])  # the new weights serve
    for url in urls:
        assert_serves(url, new)


@dataclass(frozen=True)
class Call:
    began: float  # time.monotonic()
    versions: list[int] | None  # the weight versions the answer names


class Load:
    """Two clients calling greedy completions through the router until stopped: each call's
    (prompt, tokens), and what any call raised (every call must be answered)."""

    PROMPTS = ([7, 40, 11, 90, 2], [3, 33, 8], [100, 5, 60, 21])

    def __init__(self, url: str):
        self.url = url
        self.answers: list[tuple[list[int], list[int]]] = []
        self.calls: list[Call] = []  # beside each answer: when it was asked, what it names
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._clients = [threading.Thread(target=self._client, daemon=True) for _ in range(2)]

    def start(self) -> None:
        for t in self._clients:
            t.start()
        until("calls under way", lambda: len(self.answers) >= 2, 60)

    def stop(self) -> None:
        """Once a few more calls were answered (those under way when asked end normally)."""
        if not self._stop.is_set() and self._clients[0].is_alive():
            asked = len(self.answers)
            until("calls after the rollout", lambda: len(self.answers) >= asked + 3, 60)
        self._stop.set()
        for t in self._clients:
            if t.is_alive():
                t.join(60)

    def _client(self) -> None:
        while not self._stop.is_set():
            prompt = list(self.PROMPTS[len(self.answers) % len(self.PROMPTS)])
            began = time.monotonic()
            try:
                tokens, _, versions = completion(self.url, prompt)
            except Exception as exc:  # every call must be answered
                self.errors.append(repr(exc))
                continue
            self.answers.append((prompt, tokens))
            self.calls.append(Call(began, versions))


def test_a_vllm_server_killed_mid_rollout_is_held_out_and_the_others_commit(fleet):
    """SIGKILL of one server once a rolling push is held everywhere, before its wave: it is
    quarantined (the calls it held run again on the others: every call is answered), the
    other two commit, and the rollout names it failed; it stays out, saying why, until it
    answers again (the next test)."""
    router, urls, model_dir, servers = fleet
    trainer = moved(model_dir, 9)
    sender = WeightSender(trainer, router.url, admin_key=KEY, transport="shm")
    load = Load(router.url)
    try:
        load.start()
        stats = sender.push(policy="rolling", max_unavailable=1, wave="wait")
        servers[2].kill()
        done = stats.wait(timeout=300)
        load.stop()
    finally:
        load.stop()
        sender.close()
    assert not load.errors, load.errors[:3]
    assert done.committed == [0, 1] and list(done.failed) == [2], done
    state = router.client.get("/fleet_state").json()
    assert [s["state"] for s in state] == ["serving", "serving", "quarantined"]
    assert [s["version"] for s in state[:2]] == [stats.version] * 2
    for url in urls[:2]:
        assert_serves(url, trainer)


def test_the_killed_server_restarted_on_its_checkpoint_heals_from_a_vllm_peer(fleet):
    """The server killed above, started again on its checkpoint: the router finds it behind
    (version 0), holds it out and heals it from a live vLLM replica, whose worker reads its
    weights back from vLLM's layers and pushes them as a trainer rank, planned and checked
    where they land. Only then is it routed to: it serves the fleet's version and generates
    what transformers does on the trainer's weights."""
    router, urls, model_dir, servers = fleet
    version = _weights_version(urls[0])
    servers[2].restart()

    def states() -> list:
        return [(s["state"], s["version"]) for s in router.client.get("/fleet_state").json()]

    until("the restarted server healed", lambda: states() == [("serving", version)] * 3, 180)
    assert _weights_version(urls[2]) == version
    assert_serves(urls[2], moved(model_dir, 9))


def _greedy(model, prompt: list[int], n: int = 6) -> list[int]:
    """``model``'s greedy continuation of ``prompt``, ``n`` tokens."""
    ids: list[int] = []
    with torch.no_grad():
        while len(ids) < n:
            logits = model(torch.tensor([prompt + ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids


def test_the_window_routes_need_the_admin_key_and_take_only_their_typed_messages(fleet):
    _, urls, _, _ = fleet
    route = urls[0] + "/admin/weights/window/close"
    close = WINDOW.encode(CloseWindow("no-such-token", False))
    assert _post(route, close, None)[0] == 401
    assert _post(route, close, "wrong")[0] == 401
    status, body = _post(route, b"\x00not msgpack", KEY)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_value"
    status, body = _post(urls[0] + "/admin/weights/window", close, KEY)  # not an OpenWindow
    assert status == 400 and "expected OpenWindow" in json.loads(body)["error"]["message"]
    status, body = _post(route, close, KEY)
    assert status == 409 and "no such push window" in WINDOW.decode(body).error


def _post(url: str, body: bytes, key: str | None) -> tuple[int, bytes]:
    headers = {"content-type": MEDIA_TYPE, **({"authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# one server on its own, last: a push into it alone leaves the others behind (the router would
# hold them out and heal them from it)


def _get(url: str, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_admin_route_needs_the_key(fleet):
    url = fleet[1][0]
    status, body = _get(url + "/admin/weights", None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _get(url + "/admin/weights", "wrong")[0] == 401
    with pytest.raises(DiscoveryError, match="401"):
        WeightSender(torch.nn.Linear(2, 2), url, admin_key="wrong")


def test_a_push_into_one_server_lands_and_its_completions_follow(fleet):
    _, urls, model_dir, _ = fleet
    url = urls[0]
    status, before = _get(url + "/admin/weights", KEY)
    assert status == 200 and before["modes"] == ["staged"] and before["torn"] is None
    model = moved(model_dir, 6)
    stats = WeightSender(model, url, admin_key=KEY).push()
    assert stats.version == before["version"] + 1 and stats.bytes_moved == stats.bytes_needed
    assert len(stats.bytes_by_receiver) == 1  # the server's one worker
    assert _get(url + "/admin/weights", KEY)[1]["version"] == stats.version
    assert_serves(url, model)

"""A fleet of ``vllm serve`` replicas behind ``tandem router``: three real vLLM CPU servers (one
worker each, tandem's worker extension and middleware, the router's admin key), one real
router process, real HTTP. Requests spread over the replicas and equal transformers; the
router's ``/fleet_state`` names each replica's weight version; one push through the router's
URL updates every vLLM server (the trainer sending each byte once, relayed server to server
over dist), after which each generates what transformers does on the pushed weights; a push
vLLM cannot take (rolling, in place) is refused before any byte moves, naming why. Last, one
server alone: a trainer finds its exchange through ``GET /admin/weights`` (admin key) and
pushes into it directly; its completions then equal transformers on the trainer's weights.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there). The servers and the
router are started once for the module.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

from support.routers import Router  # noqa: E402
from support.vllm_models import MODEL, moved  # noqa: E402
from support.vllm_serving import assert_serves, complete, vllm_serves  # noqa: E402
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
    with vllm_serves(model_dir, logs, *extension, env={"TANDEM_ADMIN_KEY": KEY}) as urls:
        router = Router(*urls, extra=("--admin-key", KEY))
        try:
            until("the router sees every replica", lambda: _health(router)["status"] == "ok", 60)
            yield router, urls, model_dir
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
    router, urls, model_dir = fleet
    state = router.client.get("/fleet_state").json()
    assert [(s["url"], s["engine"], s["state"]) for s in state] == [
        (url, "vllm", "serving") for url in urls
    ]
    before = [r["requests"] for r in _health(router)["replicas"]]
    # the checkpoint the servers loaded (this module's first test: nothing pushed yet)
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for k in range(6):  # different prompts: the router spreads what no replica has cached
        prompt = [7 + k, 40 + 3 * k, 11, 90 + k, 2]
        tokens, _ = complete(router.url, prompt)
        with torch.no_grad():
            logits = start(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
    after = [r["requests"] for r in _health(router)["replicas"]]
    routed = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(routed) == 6 and sum(1 for n in routed if n) >= 2, routed


@pytest.mark.parametrize(("transport", "seed"), [("dist", 3), ("shm", 4)])
def test_one_push_through_the_router_updates_every_vllm_replica(fleet, transport, seed):
    router, urls, model_dir = fleet
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


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"policy": "rolling"}, "rolling"),
        ({"mode": "in_place"}, "in_place"),
    ],
)
def test_a_push_vllm_cannot_take_is_refused_before_any_byte_moves(fleet, options, why):
    router, urls, model_dir = fleet
    versions = [_weights_version(url) for url in urls]
    mode = options.get("mode", "staged")
    sender = WeightSender(moved(model_dir, 5), router.url, admin_key=KEY, mode=mode)
    try:
        with pytest.raises(WeightSyncError, match=why):
            sender.push(policy=options.get("policy", "all"))
    finally:
        sender.close()
    assert [_weights_version(url) for url in urls] == versions
    assert _health(router)["status"] == "ok"


def test_the_window_routes_need_the_admin_key_and_take_only_their_typed_messages(fleet):
    _, urls, _ = fleet
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
# hold them out, and a vLLM replica does not heal from a peer)


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
    _, urls, model_dir = fleet
    url = urls[0]
    status, before = _get(url + "/admin/weights", KEY)
    assert status == 200 and before["modes"] == ["staged"] and before["torn"] is None
    model = moved(model_dir, 6)
    stats = WeightSender(model, url, admin_key=KEY).push()
    assert stats.version == before["version"] + 1 and stats.bytes_moved == stats.bytes_needed
    assert len(stats.bytes_by_receiver) == 1  # the server's one worker
    assert _get(url + "/admin/weights", KEY)[1]["version"] == stats.version
    assert_serves(url, model)

"""``vllm serve`` with tandem's worker extension and middleware: a trainer finds the exchange
through ``GET /admin/weights`` (admin key) and pushes; the server's completions then equal
transformers on the trainer's weights. A real ``vllm serve`` process, real HTTP.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from support.vllm_models import MODEL, moved  # noqa: E402
from support.vllm_serving import assert_serves, vllm_serve  # noqa: E402
from tandem.exchange import WeightSender  # noqa: E402
from tandem.exchange.discovery import DiscoveryError  # noqa: E402

pytestmark = pytest.mark.timeout(300)

KEY = "tandem-test-admin-key"


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    extension = (
        "--worker-extension-cls",
        "tandem.integrations.vllm.worker.TandemWorkerExtension",
        "--middleware",
        "tandem.integrations.vllm.serve.exchange",
    )
    with vllm_serve(model_dir, log, *extension, env={"TANDEM_ADMIN_KEY": KEY}) as url:
        yield url, model_dir


def _get(url: str, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_admin_route_needs_the_key(server):
    url, _ = server
    status, body = _get(url + "/admin/weights", None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _get(url + "/admin/weights", "wrong")[0] == 401
    with pytest.raises(DiscoveryError, match="401"):
        WeightSender(torch.nn.Linear(2, 2), url, admin_key="wrong")


def test_a_push_through_the_server_lands_and_completions_follow(server):
    url, model_dir = server
    status, before = _get(url + "/admin/weights", KEY)
    assert status == 200 and before["modes"] == ["staged"] and before["torn"] is None
    model = moved(model_dir, 3)
    stats = WeightSender(model, url, admin_key=KEY).push()
    assert stats.version == before["version"] + 1 and stats.bytes_moved == stats.bytes_needed
    assert len(stats.bytes_by_receiver) == 2  # vllm serve's two workers
    assert _get(url + "/admin/weights", KEY)[1]["version"] == stats.version
    assert_serves(url, model)

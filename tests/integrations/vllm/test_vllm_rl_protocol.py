"""vLLM's own trainer-side weight-transfer client (``WeightTransferTrainerFactory``,
``HTTPVLLMWeightSyncClient``, ``ModuleSource``, ``send_weights``) drives a real `tandem serve`
(TP=2) through vLLM's RL protocol: world size, init (the trainer's group forms with both
engine ranks), pause, start / update / finish, the version named, resume; completions then
equal transformers on the trainer's weights, token for token and in log-probs. Packed (several
buffers) and unpacked transfers, each with its own group.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there); the server runs in
tandem's (``.venv``), as a user's would.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

from support.paths import REPO
from tandem.integrations.vllm.rl_client import TandemWeightSyncClient, gloo_trainer  # noqa: E402
from tandem.wire.frames import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TANDEM_PYTHON = REPO / ".venv" / "bin" / "python"
KEY = "tandem-test-admin-key"
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]


@pytest.fixture(scope="module")
def server(model_factory):
    if not TANDEM_PYTHON.exists():
        pytest.skip("tandem's venv (.venv) is not there: `make test` makes it")
    from tandem.server.process import ServerProcess

    engine_dir = model_factory("llama", seed=0)
    server = ServerProcess(
        [
            "--model",
            engine_dir,
            "--tp",
            "2",
            "--admin-key",
            KEY,
            "--kv-cache-memory",
            str(16 << 20),
            "--dtype",
            "float32",
        ],
        python=str(TANDEM_PYTHON),
    )
    try:
        yield server.url, engine_dir
    finally:
        server.stop()


def _call(url: str, method: str = "GET", body: dict | None = None, key: str | None = KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _complete(url: str, prompt: list[int]) -> tuple[list[int], list[float], int]:
    _, models = _call(url + "/v1/models")
    body = {
        "model": models["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
    }
    status, out = _call(url + "/v1/completions", "POST", body, key=None)
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], out["weight_version"]


def _trained(model_dir: str, seed: int):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def _send(url: str, model, packed: bool) -> None:
    """vLLM's trainer side, as its example runs it."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    status, world = _call(url + "/get_world_size")
    assert status == 200 and world["world_size"] == 2  # TP=2
    with gloo_trainer(timeout_s=120):
        engine = WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(
                master_address="127.0.0.1",
                master_port=free_port(),
                world_size=world["world_size"] + 1,
                rank=0,
                packed=packed,
                packed_buffer_size_bytes=200_000,
            ),  # several buffers
            client=TandemWeightSyncClient(url, KEY, timeout=120),
            source=ModuleSource(model),
        )
        try:
            assert _call(url + "/pause", "POST")[0] == 200
            engine.send_weights()
            assert _call(url + "/resume", "POST")[0] == 200
        finally:
            engine.shutdown()


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_trainer_client_pushes_and_completions_follow(server, packed):
    url, engine_dir = server
    model = _trained(engine_dir, seed=11 if packed else 12)
    before = _complete(url, PROMPTS[0])[0]
    _, info = _call(url + "/weight_info")
    _send(url, model, packed)
    _, after = _call(url + "/weight_info")
    assert int(after["weight_version"]) == int(info["weight_version"]) + 1  # finish: + 1
    named = int(after["weight_version"]) + 40  # a trainer's own step number (versions only
    status, body = _call(
        url + "/update_weight_version",
        "POST",  # go forward)
        {"new_version": str(named)},
    )
    assert status == 200 and _call(url + "/weight_info")[1]["weight_version"] == str(named)
    for ids in PROMPTS:
        tokens, logprobs, version = _complete(url, ids)
        assert version == named
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)
    assert _complete(url, PROMPTS[0])[0] != before


def test_the_weight_routes_need_the_admin_key(server):
    url, _ = server
    status, body = _call(url + "/start_weight_update", "POST", {}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _call(url + "/get_world_size", key="wrong")[0] == 401

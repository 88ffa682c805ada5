"""``vllm serve`` with tandem's worker extension and middleware: a trainer finds the exchange
through ``GET /admin/weights`` (admin key) and pushes; the server's completions then equal
transformers on the trainer's weights. A real ``vllm serve`` process, real HTTP.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

from tandem.exchange import WeightSender  # noqa: E402
from tandem.exchange.discovery import DiscoveryError  # noqa: E402
from tandem.wire.frames import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
KEY = "tandem-test-admin-key"
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    cores = sorted(os.sched_getaffinity(0))[:2]  # one per worker
    env = {
        **os.environ,
        "TANDEM_ADMIN_KEY": KEY,
        "VLLM_CPU_CI_ENV": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores)),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # vllm-cpu's `vllm` script looks its own version up under the name "vllm" and fails: its
    # server module, which `vllm serve` runs
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--kv-cache-memory-bytes",
        str(8 << 20),
        "--enforce-eager",
        "--tensor-parallel-size",
        "2",
        "--worker-extension-cls",
        "tandem.integrations.vllm.worker.TandemWorkerExtension",
        "--middleware",
        "tandem.integrations.vllm.serve.exchange",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, model_dir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _get(url: str, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _complete(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "model": None,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    _, models = _get(url + "/v1/models", None)
    body["model"] = models["data"][0]["id"]
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as r:
        choice = json.loads(r.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


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
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    stats = WeightSender(model, url, admin_key=KEY).push()
    assert stats.version == before["version"] + 1 and stats.bytes_moved == stats.bytes_needed
    assert len(stats.bytes_by_receiver) == 2  # vllm serve's two workers
    assert _get(url + "/admin/weights", KEY)[1]["version"] == stats.version
    for ids in PROMPTS:
        tokens, logprobs = _complete(url, ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-3)

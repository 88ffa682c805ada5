"""A real ``vllm serve`` (TP=2) made with ``--weight-transfer-config '{"backend": "tandem"}'`` and
no other tandem flag (tandem's plugin entry point registers the backend), pushed into by a
2-rank FSDP2 trainer (gloo processes) through vLLM's own trainer API and HTTP client
(tests/support/vllm_backend_trainer.py): each trainer rank sends its own shard, each vLLM worker
receives its slices; completions then equal transformers on the pushed weights. A trainer
whose driving rank dies mid-update leaves the old weights serving, and the next trainer's
update lands.

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

pytest.importorskip("vllm")

import torch  # noqa: E402

from support.paths import SUPPORT
from tandem.wire.frames import free_port  # noqa: E402

sys.path.insert(0, str(SUPPORT))  # the trainer script, run here and as ranks
from vllm_backend_trainer import moved  # noqa: E402

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
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
TRAINER = SUPPORT / "vllm_backend_trainer.py"


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    cores = sorted(os.sched_getaffinity(0))[:2]  # one per worker
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
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
        "--weight-transfer-config",
        json.dumps({"backend": "tandem"}),
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
            time.sleep(1)  # polling the health route, not synchronizing
        yield url, model_dir, log
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


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _complete(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "model": _get(url + "/v1/models")["data"][0]["id"],
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_serves(url: str, model: torch.nn.Module) -> None:
    """The server's greedy completions are transformers' on ``model``."""
    for ids in PROMPTS:
        tokens, logprobs = _complete(url, ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-3)


def run_trainer(url: str, model_dir: str, version: int, seed: int, fault: str | None = None):
    """vllm_backend_trainer.py as 2 ranks over gloo on loopback: their exit codes and output."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(TRAINER),
                str(rank),
                port,
                model_dir,
                url,
                str(version),
                str(seed),
                *([fault] if fault else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], "\n".join(outs)


def test_an_fsdp2_trainer_pushes_through_vllms_api_and_completions_follow(server):
    url, model_dir, _ = server
    codes, out = run_trainer(url, model_dir, version=3, seed=1)
    assert codes == [0, 0], out[-4000:]
    assert _get(url + "/weight_info")["weight_version"] == "3"
    assert_serves(url, moved(model_dir, 1))


def test_a_wrong_copy_or_a_dying_trainer_leaves_the_old_weights_and_the_next_push_lands(server):
    """At two workers: vLLM's multiprocess executor reads a failed call's answers out of step
    unless only its last worker raises (`TandemWeightTransferEngine._answer`); each push
    after a failure landing shows they stayed in step."""
    url, model_dir, log = server
    served, before = _get(url + "/weight_info")["weight_version"], _completions(url)
    codes, out = run_trainer(url, model_dir, version=20, seed=5, fault="corrupt")
    assert codes == [3, 3], out[-4000:]
    assert "rejected in verify" in out and "checksum mismatch" in out, out[-4000:]
    assert _get(url + "/weight_info")["weight_version"] == served
    assert _completions(url) == before
    codes, out = run_trainer(url, model_dir, version=21, seed=5, fault="die")
    assert codes[0] == 9, out[-4000:]  # rank 0, killed after its verify call
    assert codes[1] == 3 and "push failed" in out, out[-4000:]
    assert _get(url + "/weight_info")["weight_version"] == served
    assert _completions(url) == before  # the verified push was never committed
    codes, out = run_trainer(url, model_dir, version=22, seed=6)
    assert codes == [0, 0], out[-4000:]
    assert _get(url + "/weight_info")["weight_version"] == "22"
    assert_serves(url, moved(model_dir, 6))
    assert "dropping the push of version 21" in log.read_text()


def _completions(url: str) -> list:
    return [_complete(url, ids) for ids in PROMPTS]

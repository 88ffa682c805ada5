"""A real ``vllm serve`` (TP=2) made with ``--weight-transfer-config '{"backend": "tandem"}'`` and
no other tandem flag (tandem's plugin entry point registers the backend), pushed into by a
2-rank FSDP2 trainer (gloo processes) through vLLM's own trainer API and HTTP client
(tests/support/vllm_backend_trainer.py): each trainer rank sends its own shard, each vLLM worker
receives its slices; completions then equal transformers on the pushed weights. A trainer
whose driving rank dies mid-update leaves the old weights serving, and the next trainer's
update lands. A megatron-core GPTModel (TP=2, its vocabulary padded) pushes through the same
API as a `ModuleSource`, and completions then follow Megatron's own forward.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there).
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from support.paths import SUPPORT, rendezvous  # noqa: E402
from support.trainers import start_rank, wait_ranks  # noqa: E402
from support.vllm_models import MODEL, PROMPTS, moved  # noqa: E402
from support.vllm_serving import assert_serves, complete, vllm_serve  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TRAINER = SUPPORT / "vllm_backend_trainer.py"
MEGATRON_TRAINER = SUPPORT / "megatron_trainer.py"
# what a trainer rank imports before it does anything (about 6 s of CPU per process)
VLLM_TRAINER = (
    "torch.distributed.fsdp",
    "vllm.distributed.weight_transfer",
    "tandem.integrations.vllm",
)
MEGATRON = ("megatron.core", *VLLM_TRAINER[1:])


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    log = tmp_path_factory.mktemp("serve") / "vllm-serve.log"
    backend = ("--weight-transfer-config", json.dumps({"backend": "tandem"}))
    with vllm_serve(model_dir, log, *backend, env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url, model_dir, log


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def run_ranks(script, args, preload) -> tuple[list[int], str]:
    """``script RANK *args`` as 2 ranks over gloo on loopback (forked from a template that
    imported ``preload`` once): their exit codes and output."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [(Path(tmp, f"{rank}.out"), Path(tmp, f"{rank}.err")) for rank in range(2)]
        procs = [
            start_rank(script, [str(rank), *args], env, preload, *map(str, outs[rank]))
            for rank in range(2)
        ]
        codes = wait_ranks(procs, 240)
        return codes, "\n".join(out.read_text() + err.read_text() for out, err in outs)


def run_trainer(url: str, model_dir: str, version: int, seed: int, fault: str | None = None):
    """vllm_backend_trainer.py (FSDP2) as 2 ranks: their exit codes and output."""
    args = [rendezvous(), model_dir, url, str(version), str(seed), *([fault] if fault else [])]
    return run_ranks(TRAINER, args, VLLM_TRAINER)


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


def test_a_megatron_trainer_pushes_through_vllms_api_and_completions_follow_its_forward(
    server, tmp_path
):
    """megatron_trainer.py: a GPTModel at TP=2 over gloo (random init, its vocabulary padded
    past the model's), each rank's `ModuleSource` through vLLM's trainer API; vLLM then
    decodes what Megatron's own forward does."""
    pytest.importorskip("megatron.core")
    url, model_dir, _ = server
    served = _get(url + "/weight_info")["weight_version"]  # "default" before any push
    version = (int(served) if served.isdigit() else 0) + 1
    out, prompt = tmp_path / "megatron.json", PROMPTS[0]
    args = ["2", rendezvous(), "2", "1", model_dir, url, str(version), str(out)]
    codes, output = run_ranks(MEGATRON_TRAINER, [*args, ",".join(map(str, prompt))], MEGATRON)
    assert codes == [0, 0], output[-4000:]
    expected = json.loads(out.read_text())
    assert _get(url + "/weight_info")["weight_version"] == str(version)
    tokens, logprobs = complete(url, prompt)
    assert tokens == expected["tokens"]
    assert max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"], strict=True)) <= 1e-3


def _completions(url: str) -> list:
    return [complete(url, ids) for ids in PROMPTS]

"""Versions only go forward: a push naming a version not greater than the one its target serves
(a fleet: the newest any replica holds; a LoRA adapter: that adapter's latest) is refused
before any byte moves, with `StaleVersionError` naming both, on every trainer rank, and the
target keeps serving its weights; ``rollback=True`` takes such a version on purpose. The same
rule holds for a `tandem serve` over the exchange and over vLLM's HTTP routes (a 409 naming
the field)."""

import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import tandem
from support.lora_refs import peft_model
from support.paths import REPO
from support.serving import ADMIN_KEY, Server, greedy
from support.trainers import run_trainer
from tandem import LLM, SamplingParams, StaleVersionError
from tandem.exchange import WeightSender
from tandem.exchange.broadcast_client import BroadcastClient, TransferFailed

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8], [7, 7, 1, 40], [61, 2, 9, 9, 30, 4]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)


def _trainer(path: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _served(llm) -> list[tuple]:
    """Greedy tokens, their log-probs and the version, per prompt (every replica of a fleet
    answers some)."""
    llm.reset_prefix_cache()
    outs = llm.generate(PROMPTS, PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.weight_version) for o in outs]


def _same(got: list[tuple], served: list[tuple]) -> bool:
    """The same tokens and versions, log-probs within float noise (a fleet may batch a prompt
    with others on another replica)."""
    return [(t, v) for t, _, v in got] == [(t, v) for t, _, v in served] and all(
        abs(a - b) <= 1e-5
        for (_, x, _), (_, y, _) in zip(got, served, strict=True)
        for a, b in zip(x, y, strict=True)
    )


def _refused(push, requested: int, served: int, adapter: str | None = None) -> None:
    with pytest.raises(StaleVersionError) as caught:
        push()
    error = caught.value
    assert isinstance(error, ValueError)
    assert (error.requested, error.served, error.adapter) == (requested, served, adapter)
    message = str(error)
    assert f"version {requested} " in message and f"version {served} " in message
    assert "rollback=True" in message


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_version_not_above_the_served_one_is_refused_and_nothing_moves(model_factory, mode):
    """In place, a byte that moved would have landed in the live weights: none did."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir) as llm:
        WeightSender(_trainer(trainer_dir), llm).push(version=5)
        served = _served(llm)
        sender = WeightSender(_trainer(model_factory("llama", seed=2)), llm, mode=mode)
        for version in (2, 5):  # backwards, then the same number again
            _refused(lambda v=version: sender.push(version=v), version, 5)
            assert llm.weight_version == 5
            assert _same(_served(llm), served)
        stats = sender.push(version=2, rollback=True)
        assert stats.version == llm.weight_version == 2
        assert stats.bytes_sent == stats.bytes_needed > 0
        rolled_back = _served(llm)
        assert [s[0] for s in rolled_back] != [s[0] for s in served]
        assert {s[2] for s in rolled_back} == {2}
        assert sender.push().version == 3  # no version named: the one after the served


def test_every_trainer_rank_is_refused_together_and_the_next_push_lands(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir) as llm:
        WeightSender(_trainer(model_factory("llama", seed=2)), llm).push(version=3)
        served = _served(llm)
        # two FSDP2 trainer processes: each exits 4 when its push raised StaleVersionError
        assert run_trainer(trainer_dir, llm.exchange_address, 3, "shm") == [4, 4]
        assert llm.weight_version == 3 and _same(_served(llm), served)
        assert run_trainer(trainer_dir, llm.exchange_address, 4, "shm") == [0, 0]
        assert llm.weight_version == 4 and _served(llm) != served


def test_a_fleet_compares_with_its_newest_replica_and_rolls_back_every_replica(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        # a replica joins by a copy of a peer's version, the one it holds too: not refused
        assert llm.add_replica() == 2
        assert [(s["state"], s["version"]) for s in llm.fleet_state()] == [("serving", 0)] * 3
        WeightSender(_trainer(trainer_dir), llm).push(version=5)
        served = _served(llm)
        sender = WeightSender(_trainer(model_factory("llama", seed=2)), llm.exchange_address)
        for version in (5, 1):
            _refused(lambda v=version: sender.push(version=v), version, 5)
            state = llm.fleet_state()
            assert [(s["state"], s["version"]) for s in state] == [("serving", 5)] * 3
            assert _same(_served(llm), served)
        stats = sender.push(version=1, rollback=True)
        assert [r.state for r in stats.replicas] == ["committed"] * 3
        assert [s["version"] for s in llm.fleet_state()] == [1, 1, 1]
        assert sender.push().version == 2


def test_an_adapters_versions_go_forward_per_name(llama_dir):
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        sender = WeightSender(peft_model(llama_dir, 3), llm, lora_name="policy")
        sender.push(version=3)
        _refused(lambda: sender.push(version=3), 3, 3, "policy")
        # another adapter has versions of its own; the base weights never moved
        WeightSender(peft_model(llama_dir, 4), llm, lora_name="other").push(version=1)
        assert sender.push(version=2, rollback=True).version == 2
        adapters = {a.name: a.version for a in llm.engine.adapters.loaded()}
        assert adapters == {"policy": 2, "other": 1} and llm.weight_version == 0


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_served_engine_refuses_over_the_exchange_and_its_http_routes(model_factory):
    """A trainer in another process than the server gets the same typed error; vLLM's
    weight-transfer routes answer 409 naming the field, before any byte moves when the
    version comes with the start (tandem's client), and drop the transfer when it comes only
    with the finish."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    server = Server(engine_dir, "--admin-key", ADMIN_KEY, "--kv-cache-memory", str(16 << 20))
    try:
        WeightSender(_trainer(trainer_dir), server.url, admin_key=ADMIN_KEY).push(version=5)
        served, body = greedy(server)
        assert body["weight_version"] == 5
        other = _trainer(model_factory("llama", seed=2))
        sender = WeightSender(other, server.url, admin_key=ADMIN_KEY)
        _refused(lambda: sender.push(version=2), 2, 5)
        tokens, body = greedy(server)
        assert tokens == served and body["weight_version"] == 5

        tensors = _tensors(model_factory("llama", seed=2))
        client = BroadcastClient(server.url, ADMIN_KEY)
        try:
            with pytest.raises(TransferFailed, match="409"):
                client.push(tensors.items(), version=5)
            assert client.bytes_sent == 0  # refused at the start
            r = server.admin("POST", "/start_weight_update", json={"weight_version": "4"})
            error = r.json()["error"]
            assert r.status_code == 409 and error["param"] == "weight_version"
            assert error["code"] == "stale_version" and "4" in error["message"]
            assert "5" in error["message"]
            r = server.admin("POST", "/update_weight_version", json={"new_version": "3"})
            assert r.status_code == 409 and r.json()["error"]["param"] == "new_version"
            client.start()  # vLLM's clients name the version only at the finish
            client.send(list(tensors.items()))
            with pytest.raises(TransferFailed, match="409"):
                client.finish(4)
            tokens, body = greedy(server)
            assert tokens == served and body["weight_version"] == 5
            done = client.push(tensors.items(), version=4, rollback=True)
        finally:
            client.close()
        assert done["weight_version"] == 4
        tokens, body = greedy(server)
        assert tokens != served and body["weight_version"] == 4
    finally:
        server.stop()


def test_the_package_version_is_the_projects():
    pyproject = REPO / "pyproject.toml"
    assert tandem.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
    assert "__version__" in tandem.__all__


def test_one_engine_reports_load_and_version_and_waits_for_a_push(model_factory):
    """One replica is one engine (no fleet): `fleet_state` gives its state, version and the
    tokens running `generate` calls still owe; `wait_for_version` returns once a push from
    another thread commits, and names both versions when it times out; a fleet's own calls
    (add_replica, heal) are refused naming data_parallel_size."""
    import threading
    import time

    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir) as llm:
        assert llm.fleet is None
        assert llm.fleet_state() == [{"replica": 0, "state": "serving", "version": 0, "load": 0}]
        with pytest.raises(TimeoutError, match="serves version 0, not 1"):
            llm.wait_for_version(1, timeout=0.2)
        long = SamplingParams(n=2, max_tokens=400, ignore_eos=True)
        done = threading.Event()
        runner = threading.Thread(target=lambda: (llm.generate([PROMPTS[0]], long), done.set()))
        runner.start()
        deadline = time.monotonic() + 60
        while llm.fleet_state()[0]["load"] == 0 and not done.is_set():
            assert time.monotonic() < deadline, "generate's load never showed"
            time.sleep(0.005)
        seen = llm.fleet_state()[0]["load"]
        runner.join(120)
        assert not runner.is_alive()
        assert seen == len(PROMPTS[0]) + 2 * 400 and llm.fleet_state()[0]["load"] == 0
        pusher = threading.Thread(
            target=lambda: WeightSender(_trainer(trainer_dir), llm).push(version=3)
        )
        pusher.start()
        llm.wait_for_version(3, timeout=120)
        assert llm.weight_version == 3 and llm.fleet_state()[0]["version"] == 3
        pusher.join(60)
        for call in (llm.add_replica, lambda: llm.heal(0)):
            with pytest.raises(ValueError, match="data_parallel_size >= 2"):
                call()

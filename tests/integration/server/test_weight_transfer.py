"""vLLM's RL weight-transfer protocol on a real `tandem serve` (the routes of
`tandem.server.weight_transfer_routes`), driven by tandem's own trainer client
(`BroadcastClient`: rank 0 of a gloo group with every engine rank) from this process.

A TP=2 server takes a transfer in several buckets and then serves the trainer's weights
(greedy tokens equal to a tandem engine loaded from the trainer's checkpoint, which
test_numerics ties to transformers); bad calls are refused with the field named and leave the
served version serving; a corrupted tensor is caught by the receivers; an in-place transfer
that fails leaves the engine refusing requests until a complete one lands; an abandoned one
is closed after twice --push-phase-timeout and the engine serves again. vLLM's own client
drives the same routes in tests/integrations/vllm/test_vllm_rl_protocol.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.serving import ADMIN_KEY, ID_PROMPTS, Server, greedy, wait_for
from tandem import LLM, SamplingParams
from tandem.exchange import broadcast_client
from tandem.exchange.broadcast_client import BroadcastClient, TransferFailed
from tandem.exchange.transports.broadcast import chunks
from tandem.wire import free_port

pytestmark = pytest.mark.timeout(300)


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _expected(model_dir: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(model_dir, kv_cache_memory=16 << 20) as ref:
        return [o.outputs[0].token_ids for o in ref.generate(ID_PROMPTS, params)]


def test_chunks_follow_vllms_packing_rule():
    assert chunks([4, 4, 4], 0) == [[0], [1], [2]]  # unpacked: one broadcast each
    assert chunks([4, 4, 4, 4, 4], 7) == [[0, 1], [2, 3], [4]]  # the crossing tensor goes too
    assert chunks([10, 1, 1], 5) == [[0], [1, 2]]
    assert chunks([], 5) == []


@pytest.fixture(scope="module")
def tp2(model_factory):
    engine_dir = model_factory("llama", seed=0)
    server = Server(
        engine_dir,
        "--tp",
        "2",
        "--admin-key",
        ADMIN_KEY,
        "--kv-cache-memory",
        str(16 << 20),
        "--push-phase-timeout",
        "3",
    )
    try:
        yield server
    finally:
        server.stop()


def test_a_transfer_in_buckets_lands_on_both_ranks_and_publishes_its_version(tp2, model_factory):
    trainer_dir = model_factory("llama", seed=1)
    tensors = _tensors(trainer_dir)
    before, _ = greedy(tp2)
    assert tp2.admin("GET", "/get_world_size").json() == {"world_size": 2}
    client = BroadcastClient(tp2.url, ADMIN_KEY, bucket_bytes=40_000)  # several calls
    try:
        done = client.push(tensors.items(), version=7)
    finally:
        client.close()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert done["weight_version"] == 7 and done["tensors"] == len(tensors)
    assert client.bytes_sent == total  # every byte once from the trainer (a broadcast)
    after, body = greedy(tp2)
    assert after == _expected(trainer_dir) != before
    assert body["weight_version"] == 7
    assert tp2.admin("GET", "/weight_info").json() == {"weight_version": "7"}
    assert tp2.metric("tandem_weight_sync_seconds_count", outcome="ok") >= 1


def test_bad_calls_name_the_field_and_the_served_version_stays(tp2, model_factory):
    served, body = greedy(tp2)
    version = body["weight_version"]
    r = tp2.admin(
        "POST",
        "/update_weights",
        json={"update_info": {"names": [], "dtype_names": [], "shapes": []}},
    )
    assert r.status_code == 409 and "start_weight_update" in r.json()["error"]["message"]
    assert tp2.admin("POST", "/finish_weight_update").status_code == 409
    info = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 5}
    r = tp2.admin("POST", "/init_weight_transfer_engine", json={"init_info": info})
    assert r.status_code == 400 and r.json()["error"]["param"] == "init_info.world_size"
    r = tp2.admin(
        "POST",
        "/init_weight_transfer_engine",
        json={"init_info": info | {"world_size": 3, "backend": "x"}},
    )
    assert r.status_code == 400 and "backend" in r.json()["error"]["param"]
    t0 = time.monotonic()  # no trainer ever comes: the ranks give up after --push-phase-timeout
    r = tp2.admin(
        "POST",
        "/init_weight_transfer_engine",
        json={"init_info": info | {"world_size": 3, "master_port": free_port()}},
    )
    assert r.status_code == 502 and "did not form" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 30 and greedy(tp2)[0] == served
    r = tp2.admin("POST", "/update_weight_version", json={"new_version": "step-3"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "new_version"
    assert tp2.post("/start_weight_update").status_code == 401  # no admin key

    # a tensor the engine does not hold, then one of the wrong shape: the bytes are received
    # (the trainer is not left hanging), the transfer dropped, the served weights untouched
    trainer = _tensors(model_factory("llama", seed=2))
    name = next(n for n in trainer if n.endswith("q_proj.weight"))
    for bad in ({"model.bogus.weight": torch.zeros(3, 4)}, {name: torch.zeros(3, 4)}):
        client = BroadcastClient(tp2.url, ADMIN_KEY, bucket_bytes=1 << 30)
        try:
            with pytest.raises(TransferFailed, match="400") as caught:
                client.push(list(trainer.items()) + list(bad.items()))
        finally:
            client.close()
        assert next(iter(bad)) in str(caught.value)
        tokens, now = greedy(tp2)
        assert tokens == served and now["weight_version"] == version
    r = tp2.admin("POST", "/update_weight_version", json={"new_version": version})
    assert r.status_code == 200


def test_a_tensor_corrupted_on_the_way_is_caught_and_nothing_changes(
    tp2, model_factory, monkeypatch
):
    served, _ = greedy(tp2)
    real = broadcast_client.crc32
    calls = []

    def read_differently(data, value=0):  # the sender read other bytes than it sent
        calls.append(1)
        crc = real(data, value)
        return crc ^ 1 if len(calls) == 3 else crc

    monkeypatch.setattr(broadcast_client, "crc32", read_differently)
    client = BroadcastClient(tp2.url, ADMIN_KEY)
    try:
        with pytest.raises(TransferFailed, match="checksum mismatch"):
            client.push(_tensors(model_factory("llama", seed=3)).items())
    finally:
        client.close()
    assert greedy(tp2)[0] == served


def test_an_abandoned_transfer_closes_and_the_engine_serves_again(tp2):
    served, _ = greedy(tp2)
    client = BroadcastClient(tp2.url, ADMIN_KEY)
    try:
        client.start()  # then the trainer goes quiet: the engine takes no step meanwhile
        t0 = time.monotonic()
        r = tp2.post(
            "/v1/completions",
            json={"model": tp2.model, "prompt": ID_PROMPTS[0], "max_tokens": 2, "temperature": 0},
        )
        assert r.status_code == 200 and time.monotonic() - t0 > 4  # served after the close
        r = tp2.admin("POST", "/finish_weight_update")
        assert r.status_code == 502 and "window" in r.json()["error"]["message"]
    finally:
        client.close()
    assert greedy(tp2)[0] == served


def test_in_place_a_failed_transfer_refuses_requests_until_a_complete_one(model_factory):
    engine_dir = model_factory("llama", seed=0)
    trainer = _tensors(model_factory("llama", seed=1))
    server = Server(engine_dir, "--admin-key", ADMIN_KEY, "--kv-cache-memory", str(16 << 20))
    try:
        client = BroadcastClient(server.url, ADMIN_KEY, bucket_bytes=40_000, mode="in_place")
        try:
            with pytest.raises(TransferFailed, match="400"):  # the last bucket is bad
                client.push(list(trainer.items()) + [("model.bogus", torch.zeros(2))])
            r = server.post("/v1/completions", json={"model": server.model, "prompt": "x"})
            assert r.status_code == 503, r.text  # half-written weights never serve
            assert server.get("/health").json()["reason"]
            done = client.push(trainer.items())
        finally:
            client.close()
        assert done["weight_version"] == 1  # the failed one published nothing
        assert wait_for(lambda: server.get("/health").status_code == 200)
        assert greedy(server)[0] == _expected(model_factory("llama", seed=1))
    finally:
        server.stop()


def test_a_fleet_takes_the_transfer_on_every_replica(model_factory):
    engine_dir = model_factory("llama", seed=0)
    trainer_dir = model_factory("llama", seed=1)
    server = Server(
        engine_dir, "--dp", "2", "--admin-key", ADMIN_KEY, "--kv-cache-memory", str(16 << 20)
    )
    try:
        assert server.admin("GET", "/get_world_size").json() == {"world_size": 2}
        assert server.admin("GET", "/get_world_size", params={"include_dp": "false"}).json() == {
            "world_size": 1
        }
        client = BroadcastClient(server.url, ADMIN_KEY)
        try:
            client.push(_tensors(trainer_dir).items(), version=4)
        finally:
            client.close()
        assert [r["version"] for r in server.get("/fleet_state").json()] == [4, 4]
        expected = _expected(trainer_dir)
        for _ in range(3):  # requests spread over both replicas
            assert greedy(server)[0] == expected
    finally:
        server.stop()

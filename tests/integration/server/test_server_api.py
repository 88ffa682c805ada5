"""`tandem serve` driven by the official `openai` client: outputs equal the offline `LLM`."""

import json
import socket

import openai
import pytest
import transformers

from support.serving import ADMIN_KEY, Server, wait_for
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("serve") / "serve.toml"
    config.write_text(
        f'model = "{llama_dir}"\nadmin_key = "{ADMIN_KEY}"\nserved_model_name = "tiny"\n'
        "[engine]\nkv_cache_memory = 33554432\nmax_num_seqs = 16\n"
    )
    with Server(llama_dir, config=str(config)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_dir):
    with LLM(llama_dir, kv_cache_memory=32 << 20) as llm:
        yield llm


# The server and the offline engine are separate processes, each timing its own GEMM kernels at
# start-up (tandem.layers.gemm_choice): where two kernels tie, they may pick differently and sum
# a few rows' products in another order, ~1e-6 apart in a float32 log-prob.
LOGPROB_TOL = 1e-5


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completions_equal_offline_llm(client, offline):
    prompts = ["The quick dog", "12 + 7 ="]
    got = client.completions.create(
        model="tiny",
        prompt=prompts,
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        n=2,
        logprobs=2,
        extra_body={"top_k": 50},
    )
    params = SamplingParams(
        n=2, max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7, logprobs=2
    )
    expected = offline.generate(prompts, params)
    assert len(got.choices) == 4
    for choice in got.choices:
        want = expected[choice.index // 2].outputs[choice.index % 2]
        assert choice.text == want.text
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.finish_reason == want.finish_reason
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=LOGPROB_TOL)
        assert len(choice.logprobs.top_logprobs) == len(want.token_ids)
    assert got.usage.completion_tokens == sum(len(o.token_ids) for r in expected for o in r.outputs)
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in expected)
    assert got.model_extra["weight_version"] == 0
    assert got.model_extra["weight_versions"] == [0]


def test_stop_string_and_token_ids_prompt(client, offline):
    ref = offline.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=30, temperature=0))[0]
    text = ref.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    got = client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8], max_tokens=30, temperature=0, stop=[stop]
    )
    want = offline.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=30, temperature=0, stop=[stop])
    )[0]
    assert got.choices[0].text == want.outputs[0].text == text[: text.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_chat_uses_the_model_template(client, offline, llama_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)  # the independent reference
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = offline.generate(
        [ids], SamplingParams(max_tokens=10, temperature=0.7, seed=3, logprobs=1)
    )[0]
    got = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0.7,
        seed=3,
        logprobs=True,
        top_logprobs=1,
    )
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
        want.outputs[0].logprobs, abs=LOGPROB_TOL
    )
    assert got.usage.prompt_tokens == len(ids)


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", prompt="Every policy learns", max_tokens=20, temperature=0.8, seed=1)
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Tell me"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, seed=2)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=15, seed=2, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content
    )


def test_metrics_parse_and_move(server, client):
    before = server.metric("tandem_generation_tokens_total")
    requests = server.metric("tandem_requests_total", endpoint="/v1/completions", status="200")
    client.completions.create(
        model="tiny", prompt="Count", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert server.metric("tandem_generation_tokens_total") == before + 5
    assert (
        server.metric("tandem_requests_total", endpoint="/v1/completions", status="200")
        == requests + 1
    )
    assert server.metric("tandem_request_latency_seconds_count") >= 1
    assert server.metric("tandem_kv_blocks_total") > 0
    assert server.metric("tandem_weight_version") == 0


def test_prefix_cache_counts_hits_and_resets_through_admin(server, client):
    prompt = list(range(1, 41))  # 40 tokens: two full blocks of 16 are cached after one run
    params = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**params)
    queried = server.metric("tandem_prefix_cache_queried_tokens_total")
    hits = server.metric("tandem_prefix_cache_hit_tokens_total")
    steps = server.metric("tandem_engine_steps_total")
    assert server.metric("tandem_prefix_cache_blocks") >= 2
    second = client.completions.create(**params)
    assert second.choices[0].text == first.choices[0].text
    assert server.metric("tandem_prefix_cache_queried_tokens_total") == queried + 40
    assert server.metric("tandem_prefix_cache_hit_tokens_total") == hits + 32
    assert server.metric("tandem_engine_steps_total") == steps + 2
    assert server.metric("tandem_decode_tokens_total") > 0
    assert 0 < server.metric("tandem_prefix_cache_hit_rate") < 1
    assert server.post("/reset_prefix_cache").status_code == 401
    assert server.admin("POST", "/reset_prefix_cache").json() == {"reset": True}
    assert server.metric("tandem_prefix_cache_blocks") == 0
    client.completions.create(**params)
    assert server.metric("tandem_prefix_cache_hit_tokens_total") == hits + 32, "nothing cached"


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    body = {
        "model": "tiny",
        "prompt": "A long story",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with server.client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.metric("tandem_kv_blocks_used") > 0
    # the connection is closed: the sequence is aborted and its blocks return to the pool
    assert wait_for(lambda: server.metric("tandem_kv_blocks_used") == 0, timeout=10)
    assert server.metric("tandem_running_sequences") == 0
    assert server.metric("tandem_generation_tokens_total") < 10_000


def test_client_leaving_a_non_streamed_request_is_a_499(server):
    """As vLLM and nginx count it, whether the client leaves while its body arrives or while it
    waits: the request is aborted, no 500, no traceback in the log."""
    labels = {"endpoint": "/v1/completions", "status": "499"}
    left = server.metric("tandem_requests_total", **labels)
    errors = server.metric("tandem_requests_total", endpoint="/v1/completions", status="500")
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": "tiny", "prompt": "A long story", "max_tokens": 400, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as s:  # closes halfway through the body
        s.sendall(head + body[:10])
    assert wait_for(lambda: server.metric("tandem_requests_total", **labels) == left + 1)
    assert server.admin("POST", "/pause?mode=keep").status_code == 200  # it waits: no race
    try:
        with socket.create_connection((host, int(port))) as s:  # closes before the answer
            s.sendall(head + body)
            assert wait_for(lambda: server.metric("tandem_queue_depth") == 1, timeout=10)
        assert wait_for(
            lambda: server.metric("tandem_requests_total", **labels) == left + 2, timeout=10
        ), server.output
        assert wait_for(lambda: server.metric("tandem_queue_depth") == 0, timeout=10)
    finally:
        assert server.admin("POST", "/resume").status_code == 200
    assert server.metric("tandem_running_sequences") == 0
    assert (
        server.metric("tandem_requests_total", endpoint="/v1/completions", status="500") == errors
    )
    assert "Traceback" not in server.output


def test_admin_routes_need_the_key(server):
    assert server.get("/admin/weights").status_code == 401
    wrong = server.client.get("/admin/weights", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"
    assert server.post("/sleep").status_code == 401
    info = server.admin("GET", "/admin/weights").json()
    assert info["version"] == 0 and info["exchange"]["port"] > 0
    assert "shm" in info["transports"]


def test_the_resolved_dtype_is_reported(server):
    """dtype "auto" (the default), pinned to float32 for the tests (conftest)."""
    assert server.admin("GET", "/admin/weights").json()["dtype"] == "float32"
    assert server.metric("tandem_dtype_info", dtype="float32", source="environment") == 1


def test_sleep_releases_kv_and_wake_resumes(server, client):
    assert server.admin("POST", "/sleep").json()["is_sleeping"] is True
    assert server.get("/health").json()["sleeping"] is True
    assert server.metric("tandem_engine_sleeping") == 1
    import threading

    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault(
            "r", client.completions.create(model="tiny", prompt="wait", max_tokens=3)
        )
    )
    t.start()
    assert wait_for(lambda: server.metric("tandem_queue_depth") == 1, timeout=10)
    assert "r" not in result  # queued while asleep
    assert server.admin("POST", "/wake_up").json()["is_sleeping"] is False
    t.join(timeout=30)
    assert result["r"].usage.completion_tokens >= 1


def test_every_response_is_json_with_an_error_object(server):
    r = server.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert json.loads(server.get("/nope").text)["error"]["type"] == "not_found_error"

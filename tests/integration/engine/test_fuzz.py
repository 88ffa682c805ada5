"""Property-based fuzzing of one real `tandem serve`: every hostile request (strategies in
hostile.py) gets a 4xx with an OpenAI-style error body, never a 5xx or a hang, and normal
requests keep succeeding in between and afterwards."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import hostile
from support.serving import ADMIN_KEY, Server

pytestmark = pytest.mark.timeout(600)
CONTEXT = 128
MAX_REQUEST_BYTES = 65536
FUZZERS = ("completions", "chat", "raw", "paths")
SENT: dict[str, int] = {}  # requests sent, by fuzzer
FUZZ = settings(
    max_examples=270,
    deadline=None,
    derandomize=True,  # the same requests on every run: CI is reproducible
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
CONTENT_TYPES = [
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "application/xml",
    "",
]


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    model = model_factory("llama", max_position_embeddings=CONTEXT)
    config = tmp_path_factory.mktemp("fuzz") / "serve.toml"
    config.write_text(
        f'model = "{model}"\nadmin_key = "{ADMIN_KEY}"\nmax_request_bytes = {MAX_REQUEST_BYTES}\n'
        "[engine]\nkv_cache_memory = 8388608\nmax_num_seqs = 4\n"
    )
    with Server(model, config=str(config)) as s:
        s.client.timeout = httpx.Timeout(30.0)  # a hang fails the test rather than stalling CI
        yield s


def send(server, fuzzer: str, method: str, path: str, **kw) -> httpx.Response:
    SENT[fuzzer] = SENT.get(fuzzer, 0) + 1
    if SENT[fuzzer] % 100 == 0:
        normal_request_succeeds(server)
    return server.client.request(method, path, **kw)


def normal_request_succeeds(server) -> None:
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def assert_openai_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


def post_json(server, fuzzer: str, path: str, body: dict) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return send(server, fuzzer, "POST", path, content=hostile.encode(body), headers=headers)


@FUZZ
@given(mutation=hostile.completion_mutations(CONTEXT), stream=st.booleans())
def test_hostile_completions_get_4xx(server, mutation, stream):
    base = {"model": server.model, "prompt": "hi", "max_tokens": 1, "stream": stream}
    r = post_json(server, "completions", "/v1/completions", hostile.apply(base, mutation))
    assert_openai_error(r)


@FUZZ
@given(mutation=hostile.chat_mutations(CONTEXT), stream=st.booleans())
def test_hostile_chat_requests_get_4xx(server, mutation, stream):
    base = {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "stream": stream,
    }
    r = post_json(server, "chat", "/v1/chat/completions", hostile.apply(base, mutation))
    assert_openai_error(r)


@FUZZ
@given(
    data=st.data(),
    content_type=st.sampled_from(CONTENT_TYPES),
    chunked=st.booleans(),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_malformed_bodies_get_4xx(server, data, content_type, chunked, path):
    valid = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    raw = data.draw(hostile.raw_bodies(valid, MAX_REQUEST_BYTES))
    content = iter([raw[i : i + 8192] for i in range(0, len(raw), 8192)]) if chunked else raw
    r = send(server, "raw", "POST", path, content=content, headers={"content-type": content_type})
    assert_openai_error(r)
    if len(raw) > MAX_REQUEST_BYTES:
        assert r.status_code == 413


@FUZZ
@given(request=hostile.odd_requests(ADMIN_KEY))
def test_odd_methods_and_paths_get_4xx(server, request):
    method, path, headers = request
    assert_openai_error(send(server, "paths", method, path, headers=headers))


def test_server_still_serves_and_never_answered_5xx(server):
    from prometheus_client.parser import text_string_to_metric_families

    normal_request_succeeds(server)
    assert server.get("/health").status_code == 200 and server.proc.poll() is None
    families = text_string_to_metric_families(server.get("/metrics").text)
    answered = [s for f in families for s in f.samples if s.name == "tandem_requests_total"]
    assert not [s for s in answered if s.labels["status"].startswith("5") and s.value], answered
    if set(SENT) == set(FUZZERS):  # the whole module ran
        assert sum(SENT.values()) >= 1000, SENT

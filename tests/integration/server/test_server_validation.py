"""Bad requests get the right status and an OpenAI-style error body; the server keeps serving."""

import concurrent.futures

import httpx
import openai
import pytest

from support.serving import Server

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(model_factory):
    model = model_factory("llama", max_position_embeddings=128)
    args = [
        "--api-key",
        KEY,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--kv-cache-memory",
        str(8 << 20),
    ]
    with Server(model, *args) as s:
        s.client.headers.update(AUTH)
        yield s


def _ok(server) -> None:
    r = server.post(
        "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _completion(server, **fields):
    return {"model": server.model, "prompt": "Hello", **fields}


BAD = [
    # (what, body or raw bytes, status, param)
    ("malformed JSON", b'{"model": "x", "prompt": ', 400, None),
    ("not an object", b"[1, 2, 3]", 400, None),
    ("invalid UTF-8", b'{"model": "\xff\xfe", "prompt": "hi"}', 400, None),
    ("wrong type: max_tokens string", {"max_tokens": "16"}, 400, "max_tokens"),
    ("wrong type: temperature bool", {"temperature": True}, 400, "temperature"),
    ("wrong type: prompt number", {"prompt": 17}, 400, "prompt"),
    ("out of range: temperature", {"temperature": -0.5}, 400, "temperature"),
    ("out of range: top_p", {"top_p": 0}, 400, "top_p"),
    ("out of range: n", {"n": 0}, 400, "n"),
    ("out of range: max_tokens", {"max_tokens": -3}, 400, "max_tokens"),
    ("huge number", {"max_tokens": 10**30}, 400, "max_tokens"),
    ("token id outside the vocabulary", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("negative token id", {"prompt": [1, -2]}, 400, "prompt"),
    ("empty prompt", {"prompt": ""}, 400, "prompt"),
    ("unknown field", {"temprature": 0.5}, 400, "temprature"),
    ("unsupported: penalty", {"presence_penalty": 1.0}, 400, "presence_penalty"),
    ("max_tokens 0 without echo", {"max_tokens": 0}, 400, "max_tokens"),
    ("request_id with a space", {"request_id": "a b"}, 400, "request_id"),
    ("detokenize as a string", {"detokenize": "no"}, 400, "detokenize"),
    ("prompt over the context length", {"prompt": [5] * 200}, 400, "prompt"),
    ("max_tokens past the context length", {"max_tokens": 1000}, 400, "max_tokens"),
    ("missing model", None, 400, "model"),
]


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request(server, what, body, status, param):
    if isinstance(body, bytes):
        r = server.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    elif body is None:
        r = server.post("/v1/completions", json={"prompt": "hi"})
    else:
        r = server.post("/v1/completions", json=_completion(server, **body))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"].split(".")[0] == param
    _ok(server)


def test_limits_name_the_field_the_prompt_and_the_limit(server):
    """As OpenAI and vLLM: max_tokens past the context is a 400 naming the field and the
    limit, not clamped; a bad prompt of several is named by its index."""
    r = server.post("/v1/completions", json=_completion(server, max_tokens=10**9))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "1000000000" in r.json()["error"]["message"] and "128" in r.json()["error"]["message"]
    r = server.post("/v1/completions", json=_completion(server, prompt=[[5, 6], [5, 10**9]]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"].startswith("prompt 1: "), r.text
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        r = server.post("/v1/chat/completions", json=chat | {field: 1000})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    long = {"model": server.model, "messages": [{"role": "user", "content": "hi " * 300}]}
    r = server.post("/v1/chat/completions", json=long)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    _ok(server)


# Every optional field OpenAI's API accepts as null, and vLLM's extensions it accepts as null;
# null means the field's default. (`max_tokens: null` is not the default 16 of /v1/completions
# but up to the context, as in vLLM, so the completions list leaves it out.)
NULLABLE = {
    "/v1/completions": [
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
        "top_k",
        "stop_token_ids",
        "return_token_ids",
    ],
    "/v1/chat/completions": [
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "n",
        "presence_penalty",
        "response_format",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "top_k",
        "stop_token_ids",
        "return_token_ids",
    ],
}


def _base(server, route: str) -> dict:
    if route == "/v1/completions":
        return _completion(server)
    return {"model": server.model, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.parametrize("route", NULLABLE)
def test_null_means_the_default(server, route):
    nulls = dict.fromkeys(NULLABLE[route])
    r = server.post(route, json=_base(server, route) | nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    # same seed: the sampled tokens show temperature, top_p, top_k, n... took their defaults
    seeded = server.post(route, json=_base(server, route) | nulls | {"seed": 7})
    plain = server.post(route, json=_base(server, route) | {"seed": 7})
    assert seeded.status_code == plain.status_code == 200, seeded.text
    assert seeded.json()["choices"] == plain.json()["choices"]
    assert seeded.json()["usage"] == plain.json()["usage"]


def test_null_is_still_a_wrong_type_where_vllm_refuses_it(server):
    for field in ("ignore_eos", "priority", "model", "prompt"):
        r = server.post("/v1/completions", json=_completion(server, **{field: None}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    _ok(server)


def test_openai_client_none_is_null(server):
    """The official client sends ``temperature=None`` as ``"temperature": null``."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    nones = dict(
        temperature=None,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        stop=None,
        logit_bias=None,
        user=None,
    )
    kw = dict(model=server.model, prompt="Hello", max_tokens=5, seed=3)
    assert client.completions.create(**kw, **nones, echo=None, logprobs=None).choices[0].text == (
        client.completions.create(**kw).choices[0].text
    )
    kw = dict(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, seed=3
    )
    got = client.chat.completions.create(**kw, **nones, logprobs=None, top_logprobs=None)
    assert got.choices[0].message.content == (
        client.chat.completions.create(**kw).choices[0].message.content
    )


def test_chat_without_template_is_400(model_factory, tmp_path):
    import json
    import shutil

    model = tmp_path / "no-template"
    shutil.copytree(model_factory("llama", max_position_embeddings=128), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with Server(str(model)) as s:
        r = s.post(
            "/v1/chat/completions",
            json={"model": s.model, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "no_chat_template"
        assert s.post("/v1/completions", json={"model": s.model, "prompt": "x"}).status_code == 200


def test_wrong_model_is_404(server):
    r = server.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", headers=headers, json=_completion(server))
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
    _ok(server)


def test_admin_routes_disabled_without_admin_key(server):
    r = server.get("/admin/weights")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_body_over_the_limit_is_413(server):
    r = server.post("/v1/completions", json=_completion(server, prompt="x" * (5 << 20)))
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"
    _ok(server)


def test_queue_full_is_429_with_retry_after(server):
    body = _completion(server, max_tokens=60, ignore_eos=True)

    def send(_):
        return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)

    # one request runs (max_num_seqs=1), one waits (max_waiting_requests=1): the rest are 429
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(send, range(6)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes, codes
    assert set(codes) <= {200, 429}
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "rate_limit_error"
    _ok(server)

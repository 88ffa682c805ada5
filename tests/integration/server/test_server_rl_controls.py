"""The RL controls of `tandem serve` driven over real HTTP: pause (abort / wait / keep), resume,
abort_requests, sleep / wake_up, and the token-level extras RL and eval clients use (prompt
scoring with echo, token ids in and out, no detokenization); a push while paused with
``keep``, whose version spans are checked token by token against transformers."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
import transformers

from support.serving import ADMIN_KEY, Server, push, wait_for

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 99, 3, 250, 42, 7]


@pytest.fixture(scope="module")
def server(llama_dir):
    with Server(
        llama_dir,
        "--admin-key",
        ADMIN_KEY,
        "--kv-cache-memory",
        str(32 << 20),
        "--served-model-name",
        "tiny",
    ) as s:
        yield s


def _body(**fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True} | fields


def _chunks(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _run(
    server: Server, body: dict, path: str = "/v1/completions"
) -> tuple[threading.Thread, dict]:
    """A non-streamed completion on a thread of its own: (thread, {"r": response})."""
    out: dict = {}
    client = httpx.Client(base_url=server.url, timeout=120)

    def call():
        with client:
            out["r"] = client.post(path, json=body)

    thread = threading.Thread(target=call)
    thread.start()
    return thread, out


def _running(server: Server, n: int = 1) -> bool:
    return (
        server.metric("tandem_running_sequences") >= n
        and server.metric("tandem_generation_tokens_total") > 0
    )


def test_pause_abort_returns_partial_rollouts_then_resume(server):
    before = server.metric("tandem_generation_tokens_total")
    thread, out = _run(server, _body(max_tokens=500, logprobs=0, n=2))
    assert wait_for(lambda: server.metric("tandem_generation_tokens_total") > before + 8)
    # held first, so both samples are still running when the abort lands (the engine runs
    # 500 tokens of this model in about 0.2 s, this test's poll is 0.1 s); abort replaces keep
    assert server.admin("POST", "/pause", params={"mode": "keep"}).json()["aborted"] == 0
    r = server.admin("POST", "/pause", params={"mode": "abort"})
    assert r.status_code == 200, r.text
    assert r.json() == {"paused": True, "mode": "abort", "aborted": 2}
    thread.join(timeout=30)
    body = out["r"].json()
    for choice in body["choices"]:
        assert choice["finish_reason"] == "abort"
        assert 0 < len(choice["token_ids"]) < 2000
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert server.admin("GET", "/is_paused").json() == {"is_paused": True, "mode": "abort"}
    # a request made while paused waits; resume lets it run
    later, result = _run(server, _body(max_tokens=3))
    assert wait_for(lambda: server.metric("tandem_queue_depth") == 1)
    assert later.is_alive()
    assert server.admin("POST", "/resume").json() == {"paused": False}
    later.join(timeout=30)
    assert result["r"].json()["choices"][0]["finish_reason"] == "length"
    assert server.admin("GET", "/is_paused").json()["is_paused"] is False


def test_pause_wait_answers_once_running_requests_finished(server):
    paused: dict = {}

    def pause():
        paused["r"] = server.admin("POST", "/pause", json={"mode": "wait"})
        paused["running"] = server.metric("tandem_running_sequences")

    with server.client.stream(
        "POST", "/v1/completions", json=_body(max_tokens=200, stream=True)
    ) as response:
        chunks = _chunks(response)
        first = next(chunks)  # running now
        waiter = threading.Thread(target=pause)
        waiter.start()
        rest = list(chunks)
    waiter.join(timeout=30)
    assert paused["r"].status_code == 200 and paused["r"].json()["aborted"] == 0
    assert paused["running"] == 0  # /pause answered after the running request finished
    choices = [c["choices"][0] for c in [first, *rest] if c["choices"]]
    assert sum(len(c["token_ids"]) for c in choices) == 200
    assert choices[-1]["finish_reason"] == "length"
    later, result = _run(server, _body(max_tokens=2))
    assert wait_for(lambda: server.metric("tandem_queue_depth") == 1)
    server.admin("POST", "/resume")
    later.join(timeout=30)
    assert len(result["r"].json()["choices"][0]["token_ids"]) == 2


def test_abort_requests_by_id_and_all(server):
    first, a = _run(server, _body(max_tokens=500, request_id="rollout-a"))
    assert wait_for(lambda: _running(server))  # rollout-a runs
    # held (not finished) until the abort lands: a fast engine ran 500 tokens in less time
    # than the calls below took
    assert server.admin("POST", "/pause", json={"mode": "keep"}).json()["aborted"] == 0
    second, b = _run(server, _body(max_tokens=60, request_id="rollout-b"))
    dup = server.post("/v1/completions", json=_body(max_tokens=2, request_id="rollout-a"))
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "request_id"
    r = server.admin("POST", "/abort_requests", json={"request_ids": ["rollout-a"]})
    assert r.json() == {"aborted": ["rollout-a"]}
    server.admin("POST", "/resume")
    first.join(timeout=30)
    second.join(timeout=30)
    assert a["r"].json()["id"] == "rollout-a"
    assert a["r"].json()["choices"][0]["finish_reason"] == "abort"
    assert b["r"].json()["choices"][0]["finish_reason"] == "length"
    third, c = _run(server, _body(max_tokens=500))
    assert wait_for(lambda: _running(server))
    assert server.admin("POST", "/pause", json={"mode": "keep"}).json()["aborted"] == 0
    assert len(server.admin("POST", "/abort_requests?abort_all=true").json()["aborted"]) == 1
    server.admin("POST", "/resume")
    third.join(timeout=30)
    assert c["r"].json()["choices"][0]["finish_reason"] == "abort"


def test_abort_names_exactly_the_call_given(server):
    """Ids clients choose never collide with the per-prompt ids tandem derives: a chat call
    named ``foo-1`` (or ``foo-0``) is its own call, untouched by an abort of ``foo``."""
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "ignore_eos": True,
        "max_tokens": 400,
    }
    first, foo = _run(server, _body(max_tokens=500, request_id="foo"))
    assert wait_for(lambda: _running(server))
    second, foo0 = _run(server, chat | {"request_id": "foo-0"}, "/v1/chat/completions")
    third, foo1 = _run(server, chat | {"request_id": "foo-1"}, "/v1/chat/completions")
    assert wait_for(lambda: _running(server, 3))
    # held until the aborts land (a fast engine finished "foo" before them once)
    assert server.admin("POST", "/pause", json={"mode": "keep"}).json()["aborted"] == 0
    near = ["fo", "foo-2", "foo#0", "foo-1-0"]  # no live call has these ids
    assert server.admin("POST", "/abort_requests", json={"request_ids": near}).json() == {
        "aborted": []
    }
    r = server.admin("POST", "/abort_requests", json={"request_ids": ["foo"]})
    assert r.json() == {"aborted": ["foo"]}
    server.admin("POST", "/resume")
    for thread in (first, second, third):
        thread.join(timeout=60)
    assert foo["r"].json()["choices"][0]["finish_reason"] == "abort"
    for out, name in ((foo0, "foo-0"), (foo1, "foo-1")):
        assert out["r"].status_code == 200, out["r"].text
        assert out["r"].json()["id"] == name
        assert out["r"].json()["choices"][0]["finish_reason"] == "length"


def test_control_parameters_are_checked(server):
    assert server.post("/pause").status_code == 401
    assert server.get("/is_sleeping").status_code == 401
    cases = [
        ("/pause", {"params": {"mode": "freeze"}}, "mode"),
        ("/pause", {"json": {"mode": "keep", "wait": True}}, "wait"),
        ("/pause", {"params": {"mode": "keep"}, "json": {"mode": "wait"}}, "mode"),
        ("/sleep", {"params": {"level": "3"}}, "level"),
        ("/wake_up", {"json": {"tags": ["kv"]}}, "tags.0"),
        ("/abort_requests", {"json": {}}, "request_ids"),
        ("/abort_requests", {"json": {"request_ids": ["x"], "abort_all": True}}, "request_ids"),
    ]
    for path, kw, param in cases:
        r = server.admin("POST", path, **kw)
        assert r.status_code == 400, (path, kw, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert server.admin("GET", "/is_paused").json()["is_paused"] is False  # nothing changed


def test_sleep_levels_and_wake_up_tags(server):
    expected = server.post("/v1/completions", json=_body(max_tokens=6)).json()
    r = server.admin("POST", "/sleep", params={"level": 1}).json()
    assert r["is_sleeping"] and r["level"] == 1 and r["weights_released"] is False
    assert server.metric("tandem_engine_sleeping") == 1
    assert server.admin("POST", "/wake_up").json()["is_sleeping"] is False
    r = server.admin("POST", "/sleep", params={"level": 2}).json()
    assert r["is_sleeping"] and r["level"] == 2 and r["weights_released"] is True
    assert server.admin("GET", "/is_sleeping").json() == {
        "is_sleeping": True,
        "weights_released": True,
        "kv_cache_released": True,
    }
    assert server.admin("POST", "/wake_up?tags=weights").json()["is_sleeping"] is True
    woke = server.admin("POST", "/wake_up", params=[("tags", "kv_cache")]).json()
    assert woke["is_sleeping"] is False and woke["kv_blocks"] > 0
    assert woke["weights_released"] is True  # memory back, values not: refused until reload
    refused = server.post("/v1/completions", json=_body(max_tokens=2))
    assert refused.status_code == 503, refused.text
    assert "reload_weights" in refused.json()["error"]["message"]
    assert server.get("/health").status_code == 503
    reloaded = server.admin("POST", "/reload_weights").json()
    assert reloaded["weight_version"] == 0 and reloaded["weights_released"] is False
    again = server.post("/v1/completions", json=_body(max_tokens=6)).json()
    assert again["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert server.get("/health").status_code == 200


def _reference_scores(model_dir: str, ids: list[int]) -> list[float]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def test_echo_scores_the_prompt_as_openai_does(server, llama_dir):
    want = _reference_scores(llama_dir, PROMPT)
    scored = server.post("/v1/completions", json=_body(echo=True, logprobs=2, max_tokens=0))
    assert scored.status_code == 200, scored.text
    choice = scored.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # two alternatives each (fewer where both decode to the same text: OpenAI keys by text)
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert sum(len(top) == 2 for top in lp["top_logprobs"][1:]) >= len(PROMPT) // 2
    assert len(lp["tokens"]) == len(PROMPT) == len(lp["text_offset"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"] == "".join(lp["tokens"])
    # lm-evaluation-harness's loglikelihood request: one generated token after the prompt
    lm_eval = server.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": [PROMPT],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "echo": True,
            "seed": 1234,
        },
    )
    lp = lm_eval.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(PROMPT) + 1
    assert lp["token_logprobs"][1 : len(PROMPT)] == pytest.approx(want, abs=1e-4)
    no_echo = server.post("/v1/completions", json=_body(max_tokens=0))
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


def test_token_ids_in_and_out_without_detokenizing(server):
    r = server.post(
        "/v1/completions",
        json=_body(max_tokens=4, logprobs=1, return_token_ids=True, detokenize=False),
    )
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and choice["text"] == ""
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["weight_versions"] == [{"version": 0, "start": 0, "end": 4}]
    chat = server.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "return_token_ids": True,
        },
    )
    assert chat.json()["choices"][0]["prompt_token_ids"]
    stop = server.post("/v1/completions", json=_body(detokenize=False, stop=["x"]))
    assert stop.status_code == 400


def _merged(spans: list[dict]) -> list[list[int]]:
    out: list[list[int]] = []
    for s in spans:
        if out and out[-1][0] == s["version"] and out[-1][2] == s["start"]:
            out[-1][2] = s["end"]
        else:
            out.append([s["version"], s["start"], s["end"]])
    return out


def test_pause_keep_push_resume_version_spans(model_factory):
    """Freeze a rollout, push other weights, resume: the response's spans say where the
    push landed, tokens before it equal the old weights' greedy run, and tokens after it
    equal transformers continuing with the NEW weights over the KV cache the OLD weights
    computed (what keep means: nothing recomputed)."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    # long enough that the engine cannot finish the rollout between the client reading its
    # first tokens and the pause landing (40 tokens did, once, on a loaded CI machine)
    n = 400
    with Server(
        engine_dir,
        "--admin-key",
        ADMIN_KEY,
        "--served-model-name",
        "tiny",
        "--kv-cache-memory",
        str(16 << 20),
    ) as server:
        old = server.post("/v1/completions", json=_body(max_tokens=n)).json()
        old_tokens = old["choices"][0]["token_ids"]
        tokens, spans = [], []
        body = _body(max_tokens=n, stream=True)
        with server.client.stream("POST", "/v1/completions", json=body) as response:
            chunks = _chunks(response)
            for chunk in chunks:
                tokens += chunk["choices"][0]["token_ids"]
                spans += chunk["choices"][0]["weight_versions"]
                if len(tokens) >= 3:
                    break
            assert server.admin("POST", "/pause", json={"mode": "keep"}).json()["aborted"] == 0
            pushed = push(server, trainer_dir, "shm")
            assert pushed.returncode == 0, pushed.stdout + pushed.stderr
            assert server.admin("GET", "/is_paused").json() == {"is_paused": True, "mode": "keep"}
            server.admin("POST", "/resume")
            for chunk in chunks:
                if chunk["choices"]:
                    tokens += chunk["choices"][0]["token_ids"]
                    spans += chunk["choices"][0]["weight_versions"]
    assert len(tokens) == n
    (v0, s0, k), (v1, s1, end) = _merged(spans)
    assert (v0, s0, v1, s1, end) == (0, 0, 1, k, n) and k >= 3
    assert tokens[:k] == old_tokens[:k]
    # the reference: old weights fill the KV cache of the prompt and the first k-1 outputs,
    # then the new weights continue from there
    old_model = transformers.AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    new_model = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    ids = PROMPT + tokens[:k]
    with torch.no_grad():
        cache = old_model(torch.tensor([ids[:-1]]), use_cache=True).cache
        want, last = [], ids[-1]
        for _ in range(n - k):
            out = new_model(torch.tensor([[last]]), cache=cache, use_cache=True)
            cache, last = out.cache, int(out.logits[0, -1].argmax())
            want.append(last)
    assert tokens[k:] == want
    assert tokens[k:] != old_tokens[k:]  # the push changed what came next

"""LoRA adapters on `tandem serve`, vLLM's way: ``--enable-lora --max-loras --max-lora-rank
--lora-modules``, ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (admin key), each
adapter a model of its own in ``/v1/models`` and in a request's ``model``.

A request with an adapter gets the greedy tokens of the merged PEFT model (transformers'
``merge_and_unload``), streamed or not, n > 1, chat or completion; loading and unloading are
refused by name (404, 400, 401, 409) with nothing half-loaded; with every slot held by running
requests a load is refused and an evicted adapter answers 429, and both succeed once those
requests end (an idle adapter read from a directory leaves its slot and comes back)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

import openai
import pytest
import torch
import transformers

from support.lora_refs import greedy, merged, peft_model, save_adapter
from support.serving import ADMIN_KEY, Server, wait_for

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 99, 3, 42]
MAX_TOKENS = 6
BASE = "tiny"


def _adapter(model_dir: str, path: Path, seed: int, **config):
    """A PEFT adapter with random non-zero A and B (`lora_refs.peft_model`), saved at
    ``path``; returns the merged model (the reference)."""
    model = peft_model(model_dir, seed, **config)
    save_adapter(model, path)
    return merged(model)


def _greedy(model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return greedy(model, prompt, max_tokens)[0]


@pytest.fixture(scope="module")
def lora(llama_dir, tmp_path_factory):
    """Adapters a (rank 4, every module), b (rank 8 on q and v, rslora), c (rank 4), big
    (rank 16: above the server's max_lora_rank 8), broken (no weights file); each served
    one's merged model, and the base model."""
    root = tmp_path_factory.mktemp("adapters")
    models = {
        "a": _adapter(llama_dir, root / "a", 1),
        "b": _adapter(
            llama_dir, root / "b", 2, r=8, alpha=16, targets=("q_proj", "v_proj"), rslora=True
        ),
        "c": _adapter(llama_dir, root / "c", 3),
    }
    _adapter(llama_dir, root / "big", 4, r=16)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text(
        (root / "a" / "adapter_config.json").read_text()
    )
    models[None] = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, dtype=torch.float32
    ).eval()
    want = {name: _greedy(m, PROMPT) for name, m in models.items()}
    assert len({tuple(t) for t in want.values()}) == 4, want  # the adapters change the output
    paths = {name: str(root / name) for name in ("a", "b", "c", "big", "broken")}
    return SimpleNamespace(paths=paths, models=models, want=want, root=root)


@pytest.fixture(scope="module")
def server(llama_dir, lora):
    """max_loras 2, max_lora_rank 8; adapter `boot` (a's directory) from --lora-modules."""
    boot = json.dumps({"name": "boot", "path": lora.paths["a"]})
    with Server(
        llama_dir,
        "--admin-key",
        ADMIN_KEY,
        "--served-model-name",
        BASE,
        "--kv-cache-memory-bytes",
        str(32 << 20),
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        boot,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _load(server: Server, name: str, path: str, **kw):
    return server.admin(
        "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, **kw
    )


def _unload(server: Server, name: str):
    return server.admin("POST", "/v1/unload_lora_adapter", json={"lora_name": name})


def _tokens(server: Server, model: str, **extra) -> list[int]:
    r = _complete(server, model, **extra)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model and body["weight_versions"] == [0]
    return body["choices"][0]["token_ids"]


def _complete(server: Server, model: str, **extra):
    return server.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        },
    )


def _models(server: Server) -> dict[str, dict]:
    return {m["id"]: m for m in server.get("/v1/models").json()["data"]}


def test_lora_modules_adapter_is_listed_and_served(server, client, lora):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[0] == BASE and "boot" in cards
    assert cards["boot"].model_extra["root"] == lora.paths["a"]
    assert cards["boot"].model_extra["parent"] == BASE
    got = client.completions.create(
        model="boot",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.model == "boot"
    assert got.choices[0].model_extra["token_ids"] == lora.want["a"]
    assert _tokens(server, BASE) == lora.want[None]


def test_adapters_loaded_over_http_equal_the_merged_peft_model(server, client, lora):
    for name in ("a", "b"):
        r = _load(server, name, lora.paths[name])
        assert r.status_code == 200, r.text
        assert r.json()["lora_name"] == name and r.json()["rank"] == {"a": 4, "b": 8}[name]
    cards = _models(server)
    assert {"boot", "a", "b"} <= set(cards) and cards["b"]["root"] == lora.paths["b"]
    # three adapters, two slots: whichever left its slot is read back for its request
    for _ in range(2):
        for model, want in (("a", "a"), ("b", "b"), ("boot", "a"), (BASE, None)):
            assert _tokens(server, model) == lora.want[want], model
    # streamed, n=2: every sample runs with the adapter
    chunks = list(
        client.completions.create(
            model="b",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    samples: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        assert chunk.model == "b"
        for choice in chunk.choices:
            samples[choice.index] += choice.model_extra["token_ids"]
    assert samples == {0: lora.want["b"], 1: lora.want["b"]}
    # chat: the rendered prompt through the merged model
    chat = client.chat.completions.create(
        model="a",
        messages=[{"role": "user", "content": "hi there"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert chat.model == "a"
    extra = chat.choices[0].model_extra
    assert extra["token_ids"] == _greedy(lora.models["a"], extra["prompt_token_ids"])


def test_loading_a_name_again_makes_a_new_version(server, lora):
    """The same name from another directory: new requests run with the new version."""
    first = _load(server, "swap", lora.paths["a"])
    assert first.status_code == 200, first.text
    assert _tokens(server, "swap") == lora.want["a"]
    second = _load(server, "swap", lora.paths["c"])
    assert second.status_code == 200, second.text
    assert second.json()["version"] == first.json()["version"] + 1
    assert _tokens(server, "swap") == lora.want["c"]
    assert _models(server)["swap"]["root"] == lora.paths["c"]
    assert _unload(server, "swap").status_code == 200


def test_unloaded_adapter_is_a_model_not_found(server, lora):
    assert _load(server, "gone", lora.paths["c"]).status_code == 200
    assert _tokens(server, "gone") == lora.want["c"]
    r = _unload(server, "gone")
    assert r.status_code == 200, r.text
    assert "gone" not in _models(server)
    r = _complete(server, "gone")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "`gone` does not exist" in r.json()["error"]["message"]
    r = _unload(server, "gone")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert _tokens(server, BASE) == lora.want[None]


def test_load_and_unload_need_the_admin_key(server, lora):
    body = {"lora_name": "x", "lora_path": lora.paths["c"]}
    assert server.post("/v1/load_lora_adapter", json=body).status_code == 401
    wrong = {"Authorization": "Bearer not-the-admin-key-at-all"}
    r = server.post("/v1/load_lora_adapter", json=body, headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "boot"}).status_code == 401
    assert "x" not in _models(server) and "boot" in _models(server)


@pytest.mark.parametrize(
    "name,path,status,message",
    [
        ("big", "big", 400, "rank 16 is above max_lora_rank 8"),
        ("broken", "broken", 400, "no adapter_model.safetensors"),
        ("nowhere", "/no/such/dir", 404, "no adapter found at /no/such/dir"),
        (BASE, "c", 400, "the served model's name"),
    ],
)
def test_bad_adapters_are_refused_by_name_and_nothing_is_loaded(
    server, lora, name, path, status, message
):
    before = _models(server)
    r = _load(server, name, lora.paths.get(path, path))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert _models(server).keys() == before.keys()
    if name != BASE:
        assert _complete(server, name).status_code == 404
    assert _tokens(server, BASE) == lora.want[None]


def test_bad_bodies_are_400_naming_the_field(server):
    r = server.admin("POST", "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = server.admin(
        "POST",
        "/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/p", "lora_pth": "/p"},
    )
    assert r.status_code == 400 and "lora_pth" in r.json()["error"]["message"]


def test_every_slot_held_by_running_requests(server, lora):
    """Both slots run requests (held by a pause, keep): a new adapter is refused (400) and an
    evicted one cannot come back (429, Retry-After); once the requests end, both work."""
    assert _load(server, "b", lora.paths["b"]).status_code == 200
    assert _load(server, "c", lora.paths["c"]).status_code == 200
    assert _tokens(server, "boot") == lora.want["a"]
    assert _tokens(server, "b") == lora.want["b"]  # slots: boot and b; c evicted (LRU)
    assert server.admin("POST", "/pause", params={"mode": "keep"}).status_code == 200
    streams = []
    try:
        for model in ("boot", "b"):  # headers come once the request is queued, its adapter held
            body = {
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 20,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            stream = server.client.stream("POST", "/v1/completions", json=body)
            streams.append((stream, stream.__enter__()))
            assert streams[-1][1].status_code == 200
        r = _complete(server, "c")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "lora_slots_busy"
        assert r.headers["retry-after"] == "1"
        r = _load(server, "d", lora.paths["c"])
        assert r.status_code == 400, r.text
        assert "max_loras=2" in r.json()["error"]["message"]
        assert "d" not in _models(server) and "c" in _models(server)
        r = _unload(server, "b")
        assert r.status_code == 409 and r.json()["error"]["code"] == "lora_in_use"
    finally:
        assert server.admin("POST", "/resume").status_code == 200
        for stream, response in streams:
            text = response.read().decode()
            assert text.rstrip().endswith("data: [DONE]")
            stream.__exit__(None, None, None)
    # the requests are over: their adapters are released (at once or after the engine thread)
    assert wait_for(lambda: _complete(server, "c").status_code == 200, timeout=30)
    assert _tokens(server, "c") == lora.want["c"]
    r = _load(server, "d", lora.paths["c"])
    assert r.status_code == 200, r.text
    assert _tokens(server, "d") == lora.want["c"]
    for name in ("c", "d"):
        assert _unload(server, name).status_code == 200
    assert _tokens(server, "b") == lora.want["b"]


def test_a_client_that_leaves_releases_its_adapter(server, lora):
    """A stream whose client goes away (the engine paused: it cannot have finished) no longer
    holds its adapter: it can be unloaded."""
    assert _load(server, "left", lora.paths["c"]).status_code == 200
    assert server.admin("POST", "/pause", params={"mode": "keep"}).status_code == 200
    try:
        body = {"model": "left", "prompt": PROMPT, "max_tokens": 50, "stream": True}
        with server.client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200  # queued, its adapter held; then it leaves
        assert wait_for(lambda: _unload(server, "left").status_code == 200, timeout=30)
    finally:
        assert server.admin("POST", "/resume").status_code == 200
    assert "left" not in _models(server)


def test_adapters_come_back_after_the_weights_are_reloaded(server, lora):
    """A reload empties the engine's slots; adapters read from a directory stay listed and
    are read back by their next request."""
    r = server.admin("POST", "/reload_weights")
    assert r.status_code == 200, r.text
    assert "boot" in _models(server)
    assert _tokens(server, "boot") == lora.want["a"]
    assert _tokens(server, BASE) == lora.want[None]


def test_a_bad_lora_module_stops_the_start_up(llama_dir, lora):
    """--lora-modules with an adapter above max_lora_rank: exit 2 naming it, before serving."""
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            llama_dir,
            "--port",
            "0",
            "--kv-cache-memory-bytes",
            str(16 << 20),
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            f"ok={lora.paths['a']}",
            f"big={lora.paths['big']}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot start: adapter 'big': rank 16 is above max_lora_rank 8" in run.stderr
    assert " on http://" not in run.stdout


# ----- without a model: flags, settings, a server without --enable-lora -----


def _serve_config(argv: list[str]):
    from tandem.cli import parser
    from tandem.server.serve_args import serve_config
    from tandem.server.vllm_flags import dashed

    args, unknown = parser().parse_known_args(["serve", *dashed(argv)])
    assert not unknown, unknown
    return serve_config(args)


@pytest.mark.timeout(60)
def test_vllm_lora_flags_are_taken():
    config = _serve_config(
        [
            "m",
            "--enable-lora",
            "--max-loras",
            "3",
            "--max_lora_rank",
            "32",
            "--lora-modules",
            "a=/x",
            '{"name": "b", "path": "/y=z"}',
            '{"name": "c", "path": "/c", "base_model_name": "m"}',
            "--lora-modules",
            "d=/d",
        ]
    )
    lora = config.engine_config().lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 3, 32)
    assert list(config.lora_modules.items()) == [
        ("a", "/x"),
        ("b", "/y=z"),
        ("c", "/c"),
        ("d", "/d"),
    ]
    assert _serve_config(["m", "--no-enable-lora"]).engine_config().lora.enable_lora is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lora-modules", "a=/x"], "needs LoRA enabled"),
        (["--enable-lora", "--lora-modules", "a"], "give name=path or JSON"),
        (["--enable-lora", "--lora-modules", "=/x"], "the name and the path must be given"),
        (["--enable-lora", "--lora-modules", "{"], "is not JSON"),
        (
            ["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "rank": 4}'],
            'strings "name", "path"',
        ),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "given twice"),
        (["--enable-lora", "--lora-modules", "m=/x"], "the served model's name"),
        (
            [
                "--enable-lora",
                "--lora-modules",
                '{"name": "a", "path": "/x", "base_model_name": "other"}',
            ],
            "is not the served model",
        ),
        (["--enable-lora", "--max-loras", "0"], "max_loras"),
        (["--enable-lora", "--data-parallel-size", "2"], "data_parallel_size > 1"),
    ],
)
def test_bad_lora_settings_name_the_problem(argv, message):
    from tandem.server.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _serve_config(["m", *argv])


@pytest.mark.timeout(60)
def test_lora_modules_in_the_toml_file(tmp_path):
    from tandem.server.config import load_config

    path = tmp_path / "serve.toml"
    path.write_text(
        'model = "m"\n[engine]\nenable_lora = true\n[lora_modules]\nsql = "/a"\nchat = "/b"\n'
    )
    assert list(load_config(path, {}).lora_modules.items()) == [("sql", "/a"), ("chat", "/b")]


@pytest.mark.timeout(60)
def test_without_enable_lora_the_routes_say_so(llama_dir):
    """In process, no engine: what a server started without --enable-lora answers."""
    from fastapi.testclient import TestClient

    from tandem.config import EngineConfig
    from tandem.server.app import build_app
    from tandem.server.config import ServeConfig
    from tandem.server.state import ServerState

    engine = SimpleNamespace(
        config=EngineConfig(model=llama_dir), max_model_len=512, lora_adapters=lambda: []
    )
    config = ServeConfig(model=llama_dir, admin_key=ADMIN_KEY, served_model_name=BASE)
    app = build_app(ServerState(config, engine, MagicMock(), MagicMock()))
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with TestClient(app) as http:
        r = http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": llama_dir},
            headers=headers,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_enabled"
        assert "--enable-lora" in r.json()["error"]["message"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_enabled"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [BASE]
        r = http.post("/v1/completions", json={"model": "a", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

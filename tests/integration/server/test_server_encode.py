"""`tandem serve --task embed | classify`: OpenAI's /v1/embeddings through the official client
and vLLM-style /v1/classify over httpx, equal to the offline engine; concurrent calls batched
together; strict validation and task errors."""

from __future__ import annotations

import base64
import threading

import numpy as np
import openai
import pytest

from support.serving import Server
from tandem import LLM

pytestmark = pytest.mark.timeout(300)
TEXTS = ["The quick dog runs", "a", "Every policy learns from the reward near the river"]


def test_embeddings_through_the_openai_client(model_factory):
    path = model_factory("bert", architectures=["BertModel"])
    with LLM(path, task="embed") as llm:
        want = llm.embed(TEXTS)
        want_mean = llm.embed(TEXTS, pooling="mean", normalize=True)
        ids = llm.engine.tokenizer.encode(TEXTS[0])
    with Server(path, "--task", "embed", "--served-model-name", "enc") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        out = client.embeddings.create(model="enc", input=TEXTS, encoding_format="float")
        assert [d.index for d in out.data] == [0, 1, 2]
        for d, w in zip(out.data, want, strict=True):
            assert d.embedding == pytest.approx(w, abs=1e-6)
        assert out.usage.prompt_tokens == sum(len(llm_ids) for llm_ids in _ids(path, TEXTS))
        raw = server.post(
            "/v1/embeddings", json={"model": "enc", "input": TEXTS[:1], "encoding_format": "base64"}
        ).json()
        vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert vector.tolist() == pytest.approx(want[0], abs=1e-6)
        body = {"model": "enc", "input": TEXTS, "pooling": "mean", "normalize": True}
        mean = server.post("/v1/embeddings", json=body).json()["data"]
        assert [d["embedding"] for d in mean] == [pytest.approx(w, abs=1e-6) for w in want_mean]
        by_ids = server.post("/v1/embeddings", json={"model": "enc", "input": ids}).json()
        assert by_ids["data"][0]["embedding"] == pytest.approx(want[0], abs=1e-6)
        for bad, param in (
            ({"input": []}, "input"),
            ({"input": "x", "dimensions": 8}, "dimensions"),
            ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
            ({"input": [[]]}, "input.0"),
            ({"input": [[5, 10**6]]}, "input"),
        ):
            r = server.post("/v1/embeddings", json={"model": "enc", **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = server.post("/v1/completions", json={"model": "enc", "prompt": "x"})
        assert r.status_code == 400  # an embed server does not generate
        r = server.post("/v1/classify", json={"model": "enc", "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"


def _ids(path: str, texts: list[str]) -> list[list[int]]:
    from tandem.engine.tokenizer import Tokenizer

    return [Tokenizer(path).encode(t) for t in texts]


def test_classify_labels_and_concurrent_calls_batched(model_factory):
    path = model_factory("bert")
    with LLM(path, task="classify") as llm:
        want = llm.classify(TEXTS)
    with Server(path, "--task", "classify", "--tp", "2", "--served-model-name", "clf") as server:
        r = server.post("/v1/classify", json={"model": "clf", "input": TEXTS})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        labels = ["negative", "neutral", "positive"]
        for d, w in zip(data, want, strict=True):
            assert d["logits"] == pytest.approx(w, abs=1e-5) and d["num_classes"] == 3
            assert d["label"] == labels[int(np.argmax(w))]
            assert sum(d["probs"]) == pytest.approx(1.0) and np.argmax(d["probs"]) == np.argmax(w)
        before = server.metric("tandem_encode_batches_total")
        results: dict[int, list] = {}

        def call(i: int) -> None:
            body = {"model": "clf", "input": TEXTS[i % 3]}
            results[i] = server.post("/v1/classify", json=body).json()["data"][0]["logits"]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert all(results[i] == pytest.approx(want[i % 3], abs=1e-5) for i in range(24))
        batches = server.metric("tandem_encode_batches_total") - before
        assert server.metric("tandem_encode_inputs_total") >= 27
        assert batches < 24  # calls that waited together ran as one batch

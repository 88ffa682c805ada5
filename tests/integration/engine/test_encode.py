"""Encoders and scoring models (`LLM(task="embed" | "classify")`) against transformers:
BERT embeddings and classifier logits (token types respected), decoder reward models, tensor
and pipeline parallel ranks, and batches of mixed lengths that never change a result."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem import LLM

pytestmark = pytest.mark.timeout(300)
TEXTS = [
    "The quick dog runs",
    "a",
    "Every policy learns from the reward because it counts many stones near the river",
    "12 + 7 = 19.",
]


def _hf(path: str, cls=transformers.AutoModelForSequenceClassification):
    return cls.from_pretrained(path, dtype=torch.float32).eval()


BATCH_INVARIANCE_TOL = 1e-5  # float32 rounding across batch shapes; 10x under the 1e-4 vs HF


def _close(got: list[float], want: torch.Tensor, tol: float = 1e-4) -> None:
    assert torch.tensor(got).shape == want.shape
    assert (torch.tensor(got) - want).abs().max().item() <= tol


@pytest.fixture(scope="module")
def bert(model_factory):
    return model_factory("bert")


@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_bert_classifier_logits_equal_transformers(bert, tp, pp):
    hf = _hf(bert)
    with LLM(bert, task="classify", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        got = llm.classify(TEXTS)
        for text, row in zip(TEXTS, got, strict=True):
            ids, types = llm.engine.tokenizer.encode_with_types(text)
            assert ids[0] == llm.engine.tokenizer.encode("[CLS]")[1]  # the post-processor's
            with torch.no_grad():
                _close(row, hf(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0])
        # token types are respected: a pair's second segment has type 1
        ids = got_ids = llm.engine.tokenizer.encode(TEXTS[0])
        types = [0] * 3 + [1] * (len(ids) - 3)
        row = llm.engine.encoder.encode([got_ids], [types], None)[0]
        with torch.no_grad():
            want = hf(torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0]
            plain = hf(torch.tensor([ids])).logits[0]
        _close(row, want)
        assert (want - plain).abs().max() > 1e-3  # the types changed the answer


def test_bert_embeddings_pooling_and_batch_invariance(model_factory):
    path = model_factory("bert", architectures=["BertModel"])
    hf = _hf(path, transformers.BertModel)
    with LLM(path, task="embed", max_num_batched_tokens=32, max_num_seqs=8) as llm:
        together = llm.embed(TEXTS)
        alone = [llm.embed(t)[0] for t in TEXTS]
        mean = llm.embed(TEXTS, pooling="mean")
        unit = llm.embed(TEXTS, normalize=True)
        for text, row, one, avg, u in zip(TEXTS, together, alone, mean, unit, strict=True):
            ids = llm.engine.tokenizer.encode(text)
            with torch.no_grad():
                hidden = hf(torch.tensor([ids])).last_hidden_state[0]
            _close(row, hidden[0])  # the [CLS] token's last hidden state, no pooler
            _close(avg, hidden.mean(dim=0))
            # the batch does not change a result beyond float32 rounding: a GEMM's blocking
            # follows the batch's row count on some CPUs (1.04e-6 seen on an AVX2-only VM)
            assert row == pytest.approx(one, abs=BATCH_INVARIANCE_TOL)
            assert torch.tensor(u).norm().item() == pytest.approx(1.0, abs=1e-5)
        with pytest.raises(ValueError, match="pooling must be one of"):
            llm.embed(TEXTS, pooling="max")
        with pytest.raises(ValueError, match="classify needs LLM"):
            llm.classify(TEXTS)


QWEN2_REWARD = {  # qkv bias, tied embeddings, two labels
    "architectures": ["Qwen2ForSequenceClassification"],
    "model_type": "qwen2",
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    "tp,pp,overrides",
    [(1, 1, {}), (2, 1, {}), pytest.param(1, 2, {}, marks=pytest.mark.slow), (2, 1, QWEN2_REWARD)],
)
def test_reward_model_scores_the_last_token(model_factory, tp, pp, overrides):
    path = model_factory("llama_reward", **overrides)
    hf = _hf(path)
    with LLM(path, task="classify", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        got = llm.classify(TEXTS + [[5, 9, 33, 2, 17]])
        for item, row in zip(TEXTS + [[5, 9, 33, 2, 17]], got, strict=True):
            ids = llm.engine.tokenizer.encode(item) if isinstance(item, str) else item
            with torch.no_grad():
                _close(row, hf(torch.tensor([ids])).logits[0])
    assert len(got[0]) == len(hf.config.id2label)


def test_decoder_embeddings_and_task_errors(model_factory, llama_dir, bert):
    hf = transformers.AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with LLM(llama_dir, task="embed") as llm:
        rows = llm.embed(TEXTS[:2])
        for text, row in zip(TEXTS[:2], rows, strict=True):
            ids = llm.engine.tokenizer.encode(text)
            with torch.no_grad():
                _close(row, hf(torch.tensor([ids])).last_hidden_state[0, -1])
        with pytest.raises(ValueError, match="not 'generate'"):
            llm.generate(TEXTS[:1])
    with pytest.raises(ValueError, match="task='generate'.*not 'generate'"):
        LLM(bert)
    with pytest.raises(ValueError, match="task='classify'.*not 'classify'"):
        LLM(llama_dir, task="classify")
    with LLM(llama_dir) as llm, pytest.raises(ValueError, match="embed needs LLM"):
        llm.embed(TEXTS)


def test_quick_encode_bench_shape(tmp_path, monkeypatch):
    from tandem.bench.encode import BATCH_SIZES, SETUPS, run

    monkeypatch.chdir(tmp_path)
    result = run(quick=True)  # every side's logits are checked against tandem's inside
    _, _, _, count, lo, hi = SETUPS[True]
    assert result["inputs"] == count and lo * count <= result["tokens"] <= hi * count
    for side in ("tandem", "transformers", "transformers_arrival"):
        assert result[f"{side}_tokens_per_s"] > 0
    for side in ("transformers", "transformers_arrival"):
        assert set(result[f"{side}_batch_seconds"]) == {str(b) for b in BATCH_SIZES}
    assert result["padded_tokens_sorted"] >= result["tokens"]
    assert set(result["ratios"]) == {"unpadded_vs_transformers", "unpadded_vs_transformers_arrival"}


@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_vit_classifier_equals_transformers(model_factory, tp, pp):
    path = model_factory("vit")
    hf = transformers.ViTForImageClassification.from_pretrained(path, dtype=torch.float32).eval()
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(pixel_values=images).logits
    with LLM(path, task="classify", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        got = llm.classify(list(images))
        alone = llm.classify(images[1])
        with pytest.raises(ValueError, match=r"shape \(3, 32, 32\) is needed"):
            llm.classify(torch.zeros(3, 16, 16))
    for row, w in zip(got, want, strict=True):
        _close(row, w)
    assert alone[0] == pytest.approx(got[1], abs=BATCH_INVARIANCE_TOL)


def test_classify_cli_reads_images_like_transformers_image_processor(model_factory, tmp_path):
    import json
    import subprocess
    import sys

    from PIL import Image

    path = model_factory("vit")
    rng = torch.Generator().manual_seed(1)
    files = []
    for i, size in enumerate((48, 20)):  # resized to 32 x 32 either way
        pixels = torch.randint(0, 256, (size, size + 5, 3), generator=rng, dtype=torch.uint8)
        files.append(tmp_path / f"image{i}.png")
        Image.fromarray(pixels.numpy()).save(files[-1])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "classify",
            "--model",
            path,
            *[a for f in files for a in ("--image", str(f))],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    processor = transformers.ViTImageProcessor.from_pretrained(path)
    hf = transformers.ViTForImageClassification.from_pretrained(path, dtype=torch.float32).eval()
    labels = ["cat", "dog", "bird", "fish"]
    for record, file in zip(records, files, strict=True):
        pixels = processor(Image.open(file).convert("RGB"), return_tensors="pt").pixel_values
        with torch.no_grad():
            want = hf(pixel_values=pixels).logits[0]
        _close(record["logits"], want)
        assert record["label"] == labels[int(want.argmax())]

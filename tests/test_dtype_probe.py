"""``dtype="auto"``: the start-up probe's decision (on injected timings), how ``auto`` resolves
(explicit dtype, ``TANDEM_AUTO_DTYPE``, device, probe), one real probe, and an engine that
resolves once and hands every rank the concrete name."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from serving import ADMIN_KEY, Server
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine import dtype_probe
from tandem.engine.dtype_probe import (
    AUTO_ENV,
    MAX_DIM,
    SCREEN_SHAPE,
    DtypeChoice,
    probe,
    probe_shape,
    resolve_dtype,
    time_linear,
)
from tandem.models.loader import read_model_spec

pytestmark = pytest.mark.timeout(120)
SHAPE = (64, 512, 1280)


def _timer(rates: dict[tuple[torch.dtype, tuple], float], calls: list):
    """A timer giving each (dtype, shape) the GFLOP/s in ``rates`` and recording its calls."""

    def timer(dtype, shape):
        calls.append((dtype, shape))
        return 2 * shape[0] * shape[1] * shape[2] / (rates[dtype, shape] * 1e9)

    return timer


def _rates(f32: float, bf16: float, screen: tuple[float, float] = (50.0, 60.0)):
    return {(torch.float32, SCREEN_SHAPE): screen[0], (torch.bfloat16, SCREEN_SHAPE): screen[1],
            (torch.float32, SHAPE): f32, (torch.bfloat16, SHAPE): bf16}  # fmt: skip


def test_bfloat16_is_chosen_when_clearly_faster_at_the_model_shape():
    calls = []
    choice = probe(SHAPE, 2, _timer(_rates(80.0, 320.0), calls))
    assert choice.dtype == "bfloat16" and choice.source == "probe"
    assert choice.float32_gflops == pytest.approx(80.0)
    assert choice.bfloat16_gflops == pytest.approx(320.0)
    assert choice.shape == SHAPE
    assert "4.00x float32's" in choice.reason and "2 threads" in choice.reason
    assert [s for _, s in calls] == [SCREEN_SHAPE, SCREEN_SHAPE, SHAPE, SHAPE]


def test_float32_is_kept_when_bfloat16_is_not_clearly_faster():
    assert probe(SHAPE, 1, _timer(_rates(80.0, 90.0), [])).dtype == "float32"  # 1.12x
    assert probe(SHAPE, 1, _timer(_rates(80.0, 40.0), [])).dtype == "float32"
    assert probe(SHAPE, 1, _timer(_rates(80.0, 100.0), [])).dtype == "bfloat16"  # 1.25x


def test_emulated_bfloat16_stops_at_the_screen():
    """A CPU without bfloat16 units: the model-sized bfloat16 matmul is never timed."""
    calls = []
    choice = probe(SHAPE, 2, _timer(_rates(80.0, 0.4, screen=(50.0, 0.3)), calls))
    assert choice.dtype == "float32" and choice.shape == SCREEN_SHAPE
    assert choice.reason.startswith("bfloat16 looks emulated")
    assert [s for _, s in calls] == [SCREEN_SHAPE, SCREEN_SHAPE]


def test_the_probe_runs_on_the_ranks_thread_count_and_restores_it():
    seen = []
    before = torch.get_num_threads()

    def timer(dtype, shape):
        seen.append(torch.get_num_threads())
        return 1e-3

    probe(SHAPE, 1, timer)
    assert set(seen) == {1} and torch.get_num_threads() == before


def test_a_real_probe_is_quick_and_picks_a_valid_dtype(llama_dir):
    shape = probe_shape(read_model_spec(llama_dir), 1)
    start = time.perf_counter()
    choice = probe(shape, 1)
    assert time.perf_counter() - start < 2.0  # about 0.05 s idle; a loaded CI machine is slower
    assert choice.dtype in ("float32", "bfloat16")
    assert choice.float32_gflops > 0 and choice.bfloat16_gflops > 0
    assert time_linear(torch.float32, (2, 8, 8)) > 0


def test_the_probe_shape_is_the_ranks_largest_weight(model_factory):
    spec = read_model_spec(model_factory("llama"))  # hidden 64, vocab 512: the LM head is largest
    vocab = spec.vocab_size
    assert probe_shape(spec, 1) == (64, 64, vocab)
    assert probe_shape(spec, 2) == (64, 64, vocab // 2)  # the vocab-parallel head's shard
    big = read_model_spec(model_factory("llama", hidden_size=64, vocab_size=4096))
    assert probe_shape(big, 1) == (64, 64, MAX_DIM)


def test_auto_resolves_without_a_probe_when_told(llama_dir, monkeypatch):
    def no_probe(*args):
        raise AssertionError("probed")

    monkeypatch.setattr(dtype_probe, "probe", no_probe)
    spec = read_model_spec(llama_dir)
    given = resolve_dtype(EngineConfig(model=llama_dir, dtype="float32"), spec)
    assert (given.dtype, given.source) == ("float32", "configured")
    monkeypatch.setenv(AUTO_ENV, "bfloat16")
    pinned = resolve_dtype(EngineConfig(model=llama_dir), spec)
    assert (pinned.dtype, pinned.source) == ("bfloat16", "environment")
    monkeypatch.setenv(AUTO_ENV, "float64")
    with pytest.raises(ValueError, match=f"{AUTO_ENV}='float64': must be one of"):
        resolve_dtype(EngineConfig(model=llama_dir), spec)
    monkeypatch.delenv(AUTO_ENV)
    gpu = resolve_dtype(EngineConfig(model=llama_dir, device="cuda"), spec)
    assert (gpu.dtype, gpu.source) == ("bfloat16", "device")
    assert EngineConfig(model=llama_dir).dtype == "auto"
    with pytest.raises(ValueError, match="dtype 'auto' has no torch dtype"):
        _ = EngineConfig(model=llama_dir).torch_dtype


def test_an_auto_engine_probes_once_logs_and_reports_its_choice(llama_dir, monkeypatch, caplog):
    monkeypatch.delenv(AUTO_ENV)
    with caplog.at_level(logging.INFO, logger="tandem.engine.dtype_probe"):
        with LLM(llama_dir) as llm:
            choice = llm.engine.dtype_choice
            assert choice.source == "probe" and llm.dtype == choice.dtype
            assert llm.engine.executor.layouts[0].dtype == choice.dtype
            out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, temperature=0))
            assert len(out[0].outputs[0].token_ids) == 3
    (record,) = [r for r in caplog.records if r.name == "tandem.engine.dtype_probe"]
    assert record.getMessage() == f"dtype {choice.dtype} (probe): {choice.reason}"
    assert "GFLOP/s" in choice.reason


def test_every_rank_gets_the_engines_choice(llama_dir, monkeypatch):
    """The engine's probe decides for all ranks: a choice no probe could make (float16)
    reaches both worker processes of a TP=2 engine, which never probe themselves."""
    monkeypatch.delenv(AUTO_ENV)
    picked = DtypeChoice("float16", "probe", "injected", 1.0, 2.0, (64, 64, 64))
    monkeypatch.setattr(dtype_probe, "probe", lambda shape, threads: picked)
    with LLM(llama_dir, tensor_parallel_size=2) as llm:
        assert llm.dtype == "float16"
        assert [lay.dtype for lay in llm.engine.executor.layouts] == ["float16", "float16"]
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3


def test_serve_reports_the_probed_dtype_in_metrics_and_admin(llama_dir, monkeypatch):
    monkeypatch.delenv(AUTO_ENV)
    with Server(llama_dir, "--admin-key", ADMIN_KEY) as server:
        families = text_string_to_metric_families(server.get("/metrics").text)
        samples = {
            s.name: s for f in families for s in f.samples if s.name.startswith("tandem_dtype")
        }
        info = samples["tandem_dtype_info"]
        assert info.value == 1 and info.labels["source"] == "probe"
        assert "GFLOP/s" in info.labels["reason"]
        assert info.labels["dtype"] == server.admin("GET", "/admin/weights").json()["dtype"]
        assert server.metric("tandem_dtype_probe_gflops", dtype="float32") > 0
        assert server.metric("tandem_dtype_probe_gflops", dtype="bfloat16") > 0

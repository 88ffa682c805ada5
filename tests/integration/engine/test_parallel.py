"""Tensor and pipeline parallel engines: real worker processes joined by torch.distributed (gloo).

Every parallel layout must give the same greedy tokens as one process (which test_numerics holds
to transformers) and the same log-probs to 1e-5.
"""

import os
import signal
import time

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.engine.executor import EngineDeadError

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["The quick dog", "12 + 7 =", "Every policy learns from the reward", "A"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)

FAMILIES = {
    "llama": {},  # GQA: 4 heads, 2 kv heads
    "qwen2": {},
    "qwen3": {},
    "gpt2": {},
    "qwen3_moe": {},  # 6 experts: 3 per rank at TP=2 (expert parallel)
    "mixtral": {},  # 5 experts: 3 + 2 (uneven)
}
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(model_factory):
    """Single-process outputs per family, checked against transformers' greedy generate."""
    out = {}
    for family, overrides in FAMILIES.items():
        path = model_factory(family, **overrides)
        with LLM(path) as llm:
            outs = llm.generate(PROMPTS, GREEDY)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for o in outs:
            with torch.no_grad():
                full = hf.generate(
                    torch.tensor([o.prompt_token_ids]),
                    do_sample=False,
                    max_new_tokens=12,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0]
            assert o.outputs[0].token_ids == full[len(o.prompt_token_ids) :].tolist()
        out[family] = (path, outs)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_parallel_layouts_match_single_process(reference, family, tp, pp):
    path, expected = reference[family]
    with LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        got = llm.generate(PROMPTS, GREEDY)
        pids = [w["pid"] for w in llm.worker_locations()]
        assert len(pids) == tp * pp
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert _max_diff(e.outputs[0].logprobs, g.outputs[0].logprobs) <= 1e-5
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "shutdown left worker processes behind"


def test_tp4_with_two_kv_heads_replicates_kv(model_factory):
    path = model_factory("llama", num_attention_heads=4, num_key_value_heads=2)
    with LLM(path) as ref:
        expected = ref.generate(PROMPTS[:2], GREEDY)
    with LLM(path, tensor_parallel_size=4) as llm:
        got = llm.generate(PROMPTS[:2], GREEDY)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids


def test_uneven_pipeline_split_and_overlap(model_factory):
    path = model_factory("llama", num_hidden_layers=3)
    prompts = [f"Request {i} reads" for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=0, ignore_eos=True)
    with LLM(path) as ref:
        expected = ref.generate(prompts, params)
    for split in (None, [1, 2]):
        with LLM(path, pipeline_parallel_size=2, pipeline_layer_split=split) as llm:
            got = llm.generate(prompts, params)
            peak = llm.engine.stats().peak_steps_in_flight
            assert peak == 2, "the pipeline never had two steps in flight"
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            assert _max_diff(e.outputs[0].logprobs, g.outputs[0].logprobs) <= 1e-5


def test_preemption_under_tensor_parallel(llama_dir):
    prompts = [f"Request {i}: the model reads many words" for i in range(10)]
    params = SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)
    with LLM(llama_dir) as ref:
        expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    # a rank holds 1 of 2 kv heads: 2 layers x 16 slots x 1 head x 16 dims x 4 B x (k, v)
    block = 2 * 2 * 16 * 1 * 16 * 4
    with LLM(llama_dir, tensor_parallel_size=2, kv_cache_memory=10 * block) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_sizes_that_cannot_split_fail_at_start(model_factory):
    path = model_factory("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(path, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_layer_split"):
        LLM(path, pipeline_parallel_size=2, pipeline_layer_split=[2, 1])


def test_killed_worker_makes_generate_fail_fast(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2)
    try:
        llm.generate("warm up", SamplingParams(max_tokens=2))
        pids = [w["pid"] for w in llm.worker_locations()]
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=50))
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            llm.generate("again", SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_engine_process_ending_leaves_no_workers(llama_dir, ending, tmp_path):
    """Interpreter exit without shutdown(), or the engine killed outright: workers go too.
    The engine makes its rendezvous directory under $TMPDIR (here one of the test's own, so
    what appears there is this engine's), and an exit removes it."""
    import subprocess
    import sys

    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    code = (
        "import os, sys, time; from tandem import LLM, SamplingParams; "
        f"llm = LLM({llama_dir!r}, tensor_parallel_size=2); "
        "llm.generate('hi', SamplingParams(max_tokens=2)); "
        "print(*[w['pid'] for w in llm.worker_locations()], flush=True); "
        "sys.stdin.readline(); "  # (the test looks into TMPDIR meanwhile)
        + ("time.sleep(60)" if ending == "sigkill" else "sys.exit(0)")
    )
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    engines = set(tmpdir.iterdir())  # while the engine runs: its rendezvous directory
    proc.stdin.close()
    assert len(pids) == 2 and engines
    if ending == "sigkill":
        proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "worker processes outlived the engine"
    if ending == "exit":
        left = sorted(p.name for p in engines & set(tmpdir.iterdir()))
        assert not left, f"the engine left {left} in its TMPDIR"

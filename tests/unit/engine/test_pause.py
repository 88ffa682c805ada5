"""RL controls on the offline engine: pause (abort / wait / keep), resume, abort, from another
thread while `generate` runs; a push while paused lands and frozen sequences go on with it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]


def _in_thread(llm, prompts, params):
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=llm.generate(prompts, params)))
    thread.start()
    return thread, result


def _generated(llm) -> int:
    return sum(s.num_output_tokens for s in llm.engine.scheduler.unfinished())


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_pause_keep_freezes_then_a_push_lands_and_sequences_go_on(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with LLM(engine_dir) as llm:
        unpaused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        thread, result = _in_thread(llm, PROMPTS, params)
        _wait_for(lambda: _generated(llm) >= 4)
        llm.pause("keep")
        assert llm.engine.controls.paused == "keep"
        frozen = _generated(llm)
        time.sleep(0.3)
        assert _generated(llm) == frozen and thread.is_alive()  # no step while kept
        WeightSender(trainer, llm).push(version=1)  # pushes land while paused
        llm.resume()
        thread.join(timeout=60)
    outs = result["out"]
    for out, old in zip(outs, unpaused, strict=True):
        c = out.outputs[0]
        assert len(c.token_ids) == 400 and c.finish_reason == "length"
        assert out.weight_versions == [0, 1]  # tokens from before and after the push
        n = next(i for i, (a, b) in enumerate(zip(c.token_ids, old, strict=True)) if a != b)
        assert n >= 2  # the frozen prefix came from the old weights, unchanged


def test_pause_abort_returns_partial_rollouts_and_new_requests_wait_for_resume(model_factory):
    params = SamplingParams(max_tokens=400, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(model_factory("llama")) as llm:
        thread, result = _in_thread(llm, PROMPTS, params)
        _wait_for(lambda: _generated(llm) >= 4)
        llm.pause("abort")
        thread.join(timeout=30)
        for out in result["out"]:
            c = out.outputs[0]
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 400
            assert len(c.logprobs) == len(c.token_ids)
        short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        thread, result = _in_thread(llm, PROMPTS, short)
        time.sleep(0.3)
        assert thread.is_alive() and _generated(llm) == 0  # queued, not admitted
        llm.resume()
        thread.join(timeout=30)
        assert [len(o.outputs[0].token_ids) for o in result["out"]] == [3, 3]


def test_pause_wait_finishes_running_sequences_and_admits_none(model_factory):
    with LLM(model_factory("llama")) as llm:
        running = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        thread, first = _in_thread(llm, PROMPTS[:1], running)
        _wait_for(lambda: _generated(llm) >= 2)
        llm.pause("wait")
        later, second = _in_thread(llm, PROMPTS[1:], SamplingParams(max_tokens=3))
        thread.join(timeout=30)  # the running request finishes under pause(wait)
        assert first["out"][0].outputs[0].finish_reason == "length"
        time.sleep(0.2)
        assert later.is_alive()  # the new one was not admitted
        llm.resume()
        later.join(timeout=30)
        assert len(second["out"][0].outputs[0].token_ids) >= 1


def test_abort_by_request_id_and_bad_pause_mode(model_factory):
    with LLM(model_factory("llama")) as llm:
        with pytest.raises(ValueError, match="^mode must be one of"):
            llm.pause("freeze")
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        thread, result = _in_thread(llm, PROMPTS, params)
        _wait_for(lambda: _generated(llm) >= 4)
        first_id = min(s.request_id for s in llm.engine.scheduler.unfinished())
        llm.abort([first_id])
        thread.join(timeout=60)
        reasons = {o.request_id: o.outputs[0].finish_reason for o in result["out"]}
        assert reasons[first_id] == "abort"
        assert [r for rid, r in reasons.items() if rid != first_id] == ["length"]

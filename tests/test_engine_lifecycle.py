"""Engine controls the server builds on: abort frees KV blocks, sleep / wake keep outputs."""

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.state import EngineAsleepError

PARAMS = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
PROMPTS = ["The quick dog", "12 + 7 ="]


def test_abort_frees_blocks_and_the_rest_go_on(llama_dir):
    with LLM(llama_dir, kv_cache_memory=8 << 20) as llm:
        engine = llm.engine
        expected = llm.generate(PROMPTS[1], PARAMS)[0].outputs[0].token_ids
        a = engine.make_sequences("a", engine.tokenizer.encode(PROMPTS[0]), PARAMS)
        b = engine.make_sequences("b", engine.tokenizer.encode(PROMPTS[1]), PARAMS)
        engine.add(a + b)
        for _ in range(3):
            engine.step()
        used = engine.blocks.num_blocks - engine.blocks.num_free
        engine.abort(a)
        assert a[0].finish_reason == "abort" and not a[0].block_table
        assert engine.blocks.num_blocks - engine.blocks.num_free < used
        while engine.has_unfinished():
            engine.step()
        assert b[0].output_token_ids == expected  # aborting a neighbour changes nothing
        assert engine.blocks.num_free == engine.blocks.num_blocks
        waiting = engine.make_sequences("c", [1, 2, 3], PARAMS)
        engine.add(waiting)
        engine.abort(waiting)  # never scheduled: just dropped
        assert not engine.has_unfinished()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_releases_kv_cache_and_wake_restores_it(llama_dir, tp):
    with LLM(llama_dir, tensor_parallel_size=tp, kv_cache_memory=8 << 20) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        llm.sleep()
        if tp == 1:
            assert llm.engine.runner.kv_cache is None
        with pytest.raises(EngineAsleepError):
            llm.generate(PROMPTS, PARAMS)
        llm.wake()
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert after == before


def test_sleep_mid_generation_preempts_and_resumes(llama_dir):
    with LLM(llama_dir, kv_cache_memory=8 << 20) as llm:
        expected = llm.generate(PROMPTS[0], PARAMS)[0].outputs[0].token_ids
        engine = llm.engine
        seqs = engine.make_sequences("a", engine.tokenizer.encode(PROMPTS[0]), PARAMS)
        engine.add(seqs)
        for _ in range(4):
            engine.step()
        llm.sleep()  # the running sequence loses its blocks, keeps its tokens
        assert engine.blocks.num_free == engine.blocks.num_blocks
        llm.wake()
        while engine.has_unfinished():
            engine.step()
        assert seqs[0].output_token_ids == expected

"""Engine controls the server builds on: abort frees KV blocks, sleep / wake keep outputs,
sleep level 2 gives the weights' memory back until a push or a reload."""

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.engine.state import EngineAsleepError, EngineState, WeightsReleasedError
from tandem.exchange import WeightSender
from tandem.layers import gemm, gemm_choice
from tandem.layers.attention import Attention

PARAMS = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
PROMPTS = ["The quick dog", "12 + 7 ="]


def test_abort_frees_blocks_and_the_rest_go_on(llama_dir):
    with LLM(llama_dir, kv_cache_memory=8 << 20) as llm:
        engine = llm.engine
        expected = llm.generate(PROMPTS[1], PARAMS)[0].outputs[0].token_ids
        a = engine.admission.make_sequences("a", engine.tokenizer.encode(PROMPTS[0]), PARAMS)
        b = engine.admission.make_sequences("b", engine.tokenizer.encode(PROMPTS[1]), PARAMS)
        engine.add(a + b)
        for _ in range(3):
            engine.step()
        used = engine.scheduler.blocks.num_blocks - engine.scheduler.blocks.num_free
        engine.abort(a)
        assert a[0].finish_reason == "abort" and not a[0].block_table
        assert engine.scheduler.blocks.num_blocks - engine.scheduler.blocks.num_free < used
        while engine.has_unfinished():
            engine.step()
        assert b[0].output_token_ids == expected  # aborting a neighbour changes nothing
        assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
        waiting = engine.admission.make_sequences("c", [1, 2, 3], PARAMS)
        engine.add(waiting)
        engine.abort(waiting)  # never scheduled: just dropped
        assert not engine.has_unfinished()


def _kv_caches_bound(llm) -> list[bool]:
    """Per rank: True if every attention layer holds its K and V cache, False if none does
    (a mix fails the test)."""

    def bound(model) -> bool:
        caches = [
            c for m in model.modules() if isinstance(m, Attention) for c in (m.k_cache, m.v_cache)
        ]
        assert caches and len({c is None for c in caches}) == 1, "some layers hold a cache"
        return caches[0] is not None

    return llm.apply_model(bound)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_releases_kv_cache_and_wake_restores_it(llama_dir, tp):
    with LLM(llama_dir, tensor_parallel_size=tp, kv_cache_memory=8 << 20) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        if tp == 1:  # every attention layer's view of the cache, bound, then released
            assert _kv_caches_bound(llm) == [True]
        llm.sleep()
        if tp == 1:
            assert _kv_caches_bound(llm) == [False]
        with pytest.raises(EngineAsleepError):
            llm.generate(PROMPTS, PARAMS)
        llm.wake()
        if tp == 1:
            assert _kv_caches_bound(llm) == [True]
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert after == before


def test_sleep_mid_generation_preempts_and_resumes(llama_dir):
    with LLM(llama_dir, kv_cache_memory=8 << 20) as llm:
        expected = llm.generate(PROMPTS[0], PARAMS)[0].outputs[0].token_ids
        engine = llm.engine
        seqs = engine.admission.make_sequences("a", engine.tokenizer.encode(PROMPTS[0]), PARAMS)
        engine.add(seqs)
        for _ in range(4):
            engine.step()
        llm.sleep()  # the running sequence loses its blocks, keeps its tokens
        assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
        llm.wake()
        while engine.has_unfinished():
            engine.step()
        assert seqs[0].output_token_ids == expected


def test_a_sleep_forgets_the_cached_prefixes_its_kv_memory_held(llama_dir):
    """The KV cache comes back zeroed after `wake`: a prefix cached before the sleep must be
    computed again, not read from the new memory."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    prompt = list(range(5, 45))  # 10 full blocks of 4
    with LLM(llama_dir, block_size=4) as llm:
        before = llm.generate([prompt], greedy)[0].outputs[0]
        llm.sleep()
        llm.wake()
        hits = llm.engine.stats().prefix_cache_hit_tokens
        after = llm.generate([prompt], greedy)[0].outputs[0]
        assert llm.engine.stats().prefix_cache_hit_tokens == hits
    assert after.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs, strict=True)) < 1e-6


def _shared_rss(pids: list[int]) -> int:
    """Resident shared memory of these processes, in bytes (the ranks' parameter arenas)."""
    total = 0
    for pid in pids:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssShmem:"):
                total += int(line.split()[1]) * 1024
    return total


# ~30 MB of float32 weights: measurable
BIG = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sleep_level_2_releases_the_weights_until_a_reload(model_factory, tp):
    model_dir = model_factory("llama", **BIG)
    with LLM(model_dir, tensor_parallel_size=tp, kv_cache_memory=8 << 20) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        pids = [w["pid"] for w in llm.worker_locations()]
        weights = sum(
            p.numel() * 4
            for p in transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32
            ).parameters()
        )
        resident = _shared_rss(pids)
        assert resident > 0.9 * weights  # the ranks' arenas hold the weights
        llm.sleep(level=2)
        assert resident - _shared_rss(pids) > 0.9 * weights, "the weights' pages were freed"
        with pytest.raises(EngineAsleepError):
            llm.generate(PROMPTS, PARAMS)
        llm.wake()
        assert llm.engine.state is EngineState.NO_WEIGHTS
        with pytest.raises(WeightsReleasedError, match="reload_weights"):
            llm.generate(PROMPTS, PARAMS)
        assert not llm.engine.has_unfinished(), "a refused call queues nothing"
        llm.reload_weights()
        assert llm.engine.state is EngineState.RUNNING and llm.weight_version == 0
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert after == before


@pytest.mark.timeout(240)
def test_a_push_after_sleep_level_2_serves_the_trainers_weights(model_factory):
    """The colocated RL step vLLM's level 2 is for: sleep, train, push, wake."""
    engine_dir, trainer_dir = model_factory("llama", **BIG), model_factory("llama", seed=1, **BIG)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    ids = [5, 17, 99, 3, 250, 42, 7]
    with torch.no_grad():
        expected = trainer.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    with LLM(engine_dir, kv_cache_memory=8 << 20) as llm:
        llm.sleep(level=2)
        WeightSender(trainer.eval(), llm).push(version=1)
        llm.wake()
        assert llm.engine.state is EngineState.RUNNING and llm.weight_version == 1
        out = llm.generate([ids], greedy)[0]
    assert out.outputs[0].token_ids == expected and out.weight_version == 1


def test_packed_weight_copies_go_with_the_weights(llama_dir):
    """The blocked copies of the matmul weights (`tandem.layers.gemm`) are made on use, freed
    by sleep level 2 with the weights, and remade after the reload; ``packed_weights=False``
    keeps none and serves the same tokens."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(llama_dir, kv_cache_memory=8 << 20) as llm:
        [packs] = llm.apply_model(gemm.packed_weights)
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        held = [p.held for p in packs]  # the layers a oneDNN call ran (prompts: batches)
        assert packs and any(held) == (gemm_choice.kernel(torch.float32, 64) == "onednn")
        llm.sleep(level=2)
        assert not any(p.held for p in packs), "sleep level 2 keeps packed copies alive"
        llm.wake()
        llm.reload_weights()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == before
        assert [p.held for p in packs] == held
    with LLM(llama_dir, kv_cache_memory=8 << 20, packed_weights=False) as llm:
        assert llm.apply_model(gemm.packed_weights) == [[]]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == before


def test_sleep_level_is_checked(llama_dir):
    with LLM(llama_dir, kv_cache_memory=8 << 20) as llm:
        with pytest.raises(ValueError, match="level must be 1"):
            llm.sleep(level=3)
        assert llm.engine.state is EngineState.RUNNING

"""Shared prompts, prefix caching and chunked prefill: faster, never different.

Block-level rules are checked on the `BlockManager` directly (hand-computed tables, reference
counts, copies); the engine-level tests compare against the same engine with sharing and caching
off and prompts prefilled whole (`enable_prefix_caching=False`, a large token budget), which
test_numerics holds to transformers.
"""

import builtins
import hashlib
import struct

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.engine import kv_cache
from tandem.engine.kv_cache import BlockManager, block_digest
from tandem.engine.sampling_params import SamplingParams as Params
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.exchange import WeightSender

pytestmark = pytest.mark.timeout(240)

BS = 4
# Two prompts sharing 13 tokens (3 full blocks of 4), a short one, and a long one.
SHARED = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 30, 31, 32]
PROMPTS = [SHARED + [40, 41, 42], SHARED + [50], [11, 12, 13], list(range(60, 60 + 45))]


def _seq(seq_id: int, tokens: list[int], n_out: int = 8) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, tokens, Params(), n_out, 0.0)


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _same(outs, reference, tol=1e-5) -> None:
    for o, r in zip(outs, reference, strict=True):
        for c, rc in zip(o.outputs, r.outputs, strict=True):
            assert c.token_ids == rc.token_ids
            assert _max_diff(c.logprobs, rc.logprobs) <= tol


# ----- the block manager -----
def test_fork_shares_blocks_and_copies_the_partial_block_on_first_write():
    blocks = BlockManager(16, BS)
    parent, child = _seq(0, list(range(10))), _seq(1, list(range(10)))
    blocks.allocate(parent)
    assert parent.block_table == [0, 1, 2] and blocks.num_free == 13
    blocks.fork(parent, child)
    assert child.block_table == [0, 1, 2] and child.num_cached_tokens == 10
    assert blocks.num_free == 13, "a fork takes no block"
    parent.num_cached_tokens = 10
    for s in (parent, child):
        s.token_ids.append(99)  # each sampled its first token: it writes position 10 (block 2)
    assert blocks.grow(parent) == [(2, 3)], "the first writer copies the shared partial block"
    assert parent.block_table == [0, 1, 3]
    assert blocks.grow(child) == [], "the last holder writes in place"
    assert child.block_table == [0, 1, 2]
    full = BlockManager(3, BS)  # one sequence's three blocks and nothing more
    alone = _seq(2, list(range(12)))
    full.allocate(alone)
    alone.num_cached_tokens = 12
    alone.token_ids.append(99)  # its next token needs a fourth block
    assert full.grow(alone) is None, "no free block: nothing taken"
    assert alone.block_table == [0, 1, 2] and full.num_free == 0
    blocks.free(parent)
    blocks.free(child)
    assert blocks.num_free == 16


def test_prefix_cache_reuses_the_longest_computed_prefix_and_leaves_one_token():
    blocks = BlockManager(16, BS)
    first = _seq(0, SHARED + [40, 41, 42])  # 16 tokens: 4 full blocks
    blocks.allocate(first)
    first.num_cached_tokens = 16
    blocks.register(first)
    assert blocks.num_cached == 4
    other = _seq(1, SHARED + [50])  # 14 tokens: its first 3 blocks are cached
    blocks.allocate(other)
    assert other.block_table[:3] == first.block_table[:3] and other.num_cached_tokens == 12
    same = _seq(2, SHARED + [40, 41, 42])  # all 4 blocks cached: the last is recomputed
    blocks.allocate(same)
    assert same.block_table[:3] == first.block_table[:3] and same.num_cached_tokens == 12
    assert same.block_table[3] != first.block_table[3]
    changed = _seq(3, [7, 3, 9, 0] + SHARED[4:])  # differs in block 0: nothing matches
    blocks.allocate(changed)
    assert changed.num_cached_tokens == 0
    assert blocks.stats.hit_tokens == 24 and blocks.stats.queried_tokens == 16 + 14 + 16 + 13


def test_block_keys_are_sha256_of_the_parent_digest_and_the_tokens():
    tokens = [[7, 3, 9, 1], [2**40 + 5, 0, 65535, 65536]]
    first = hashlib.sha256(struct.pack("<4q", *tokens[0])).digest()
    second = hashlib.sha256(first + struct.pack("<4q", *tokens[1])).digest()
    assert block_digest(b"", tokens[0]) == first
    assert block_digest(first, tokens[1]) == second
    assert block_digest(b"", tokens[1]) != second, "the parent is part of the key"


def test_a_colliding_64_bit_hash_cannot_serve_another_prefixes_blocks(monkeypatch):
    """Keys chained through Python's 64-bit ``hash`` trust the parent's hash one level up: if
    two different first blocks hash alike, a second block cached after one of them is served
    after the other. Every first block is made to collide here (``hash`` is swapped inside the
    module; keys that do not use it are unaffected): the second block of ``b`` must not come
    from ``d``, whose first block differs."""

    def colliding(key):
        return 0 if isinstance(key, tuple) and key and key[0] is None else builtins.hash(key)

    monkeypatch.setattr(kv_cache, "hash", colliding, raising=False)
    blocks = BlockManager(16, BS)
    cached = []
    for seq_id, tokens in ((0, [1, 1, 1, 1]), (1, [2, 2, 2, 2, 5, 6, 7, 8])):
        seq = _seq(seq_id, tokens + [0])  # b's first block, then d: its own first block, then X
        blocks.allocate(seq)
        seq.num_cached_tokens = len(tokens)
        blocks.register(seq)
        cached.append(seq)
    b = _seq(2, [1, 1, 1, 1, 5, 6, 7, 8, 0])  # b's first block, then X's tokens after it
    blocks.allocate(b)
    assert b.block_table[0] == cached[0].block_table[0]
    assert b.num_cached_tokens == BS, "X's keys/values were computed after d's first block"
    assert b.block_table[1] != cached[1].block_table[1]


def test_cached_blocks_are_evicted_least_recently_used_first():
    blocks = BlockManager(5, BS)
    a, b = _seq(0, [1] * 4 + [2]), _seq(1, [3] * 4 + [4])
    for s in (a, b):
        blocks.allocate(s)
        s.num_cached_tokens = 5
        blocks.register(s)  # one full block each
    blocks.free(a)  # a's full block is released first: least recently used
    blocks.free(b)
    assert blocks.num_cached == 2 and blocks.num_free == 5
    c = _seq(2, [5] * 13)  # 4 blocks: the 3 never-cached ones, then a's block is evicted
    blocks.allocate(c)
    assert blocks.num_cached == 1
    blocks.free(c)
    hit_b, miss_a = _seq(3, [3] * 4 + [4]), _seq(4, [1] * 4 + [2])
    blocks.allocate(hit_b)
    assert hit_b.num_cached_tokens == 4, "b's block survived"
    blocks.allocate(miss_a)
    assert miss_a.num_cached_tokens == 0, "a's block was evicted"


def test_a_new_sequence_takes_evicted_blocks_in_ascending_order():
    """A released prompt's cached blocks enter the free list last block first; whoever
    evicts them lists them front to back, so a context's blocks stay adjacent in memory
    (the decode kernel streams them)."""
    blocks = BlockManager(6, BS)
    a = _seq(0, list(range(24)))  # 6 full blocks: 0..5
    blocks.allocate(a)
    assert a.block_table == [0, 1, 2, 3, 4, 5]
    a.num_cached_tokens = 24
    blocks.register(a)
    blocks.free(a)  # free list: 5, 4, 3, 2, 1, 0 (all cached)
    b = _seq(1, list(range(100, 112)))  # 3 blocks, evicting a's last three
    blocks.allocate(b)
    assert b.block_table == [3, 4, 5]
    assert blocks.num_cached == 3
    c = _seq(2, list(range(8)))  # a's first two blocks still serve
    blocks.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == 0


def test_reset_forgets_cached_blocks_and_older_sequences_never_register():
    blocks = BlockManager(16, BS)
    old = _seq(0, list(range(9)))
    blocks.allocate(old)
    old.num_cached_tokens = 8
    blocks.register(old)
    assert blocks.num_cached == 2
    blocks.reset_prefix_cache()
    assert blocks.num_cached == 0
    old.num_cached_tokens = 9
    old.token_ids += [9, 10, 11, 12]
    blocks.grow(old)
    old.num_cached_tokens = 12
    blocks.register(old)  # admitted before the reset: its KV is (partly) from the old weights
    assert blocks.num_cached == 0
    new = _seq(1, list(range(13)))
    blocks.allocate(new)
    assert new.num_cached_tokens == 0


def test_chunked_prefill_puts_decodes_first_then_prompt_chunks():
    blocks = BlockManager(64, BS)
    sched = Scheduler(blocks, 8, 10)  # 10 tokens per step
    short = _seq(0, [1, 2, 3])
    sched.add_request([short])
    batch = sched.schedule()
    assert batch.num_new_tokens == [3] and batch.samples == [True]
    short.token_ids.append(5)
    sched.finish_step(batch)
    long = _seq(1, list(range(100, 125)))  # 25 tokens: 9 + 10 + 6 over three steps
    sched.add_request([long])
    chunks = []
    for _ in range(3):
        batch = sched.schedule()
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1, "decode goes first"
        chunks.append(batch.num_new_tokens[1])
        short.token_ids.append(5)
        if batch.samples[1]:
            long.token_ids.append(6)
        sched.finish_step(batch)
    assert chunks == [9, 9, 7] and long.num_output_tokens == 1
    assert sched.counters.decode_tokens == 3 and sched.counters.prefill_tokens == 3 + 25


def test_samples_of_a_request_are_forked_when_the_prompt_is_computed():
    blocks = BlockManager(64, BS)
    sched = Scheduler(blocks, 8, 8)
    samples = [_seq(i, list(range(10))) for i in range(3)]
    sched.add_request(samples)
    assert sched.num_unfinished == 3
    first = sched.schedule()
    assert first.seqs == [samples[0]] and first.samples == [False], "an 8-token chunk"
    sched.finish_step(first)
    second = sched.schedule()
    assert second.seqs == samples and second.num_new_tokens == [2, 0, 0]
    assert second.logits_from == [None, 0, 0] and all(second.samples)
    assert samples[1].block_table == samples[0].block_table == samples[2].block_table
    assert blocks.stats.hit_tokens == 20 and blocks.stats.queried_tokens == 30


# ----- the engine -----
@pytest.fixture(scope="module")
def reference(llama_dir):
    """Outputs with sharing, caching and chunking off: each sample prefills its whole prompt."""
    with LLM(llama_dir, enable_prefix_caching=False, block_size=BS) as llm:
        return _workload(llm)


def _workload(llm: LLM):
    seeded = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, logprobs=0)
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    return [
        llm.generate(PROMPTS, seeded),
        llm.generate(PROMPTS, seeded),  # again: now from the prefix cache
        llm.generate(PROMPTS, greedy),
    ]


@pytest.mark.parametrize("budget", [2048, 7])
def test_sharing_caching_and_chunking_change_no_tokens_or_logprobs(llama_dir, reference, budget):
    seqs = min(budget, 256)  # every running sequence must fit a step's budget
    with LLM(llama_dir, block_size=BS, max_num_batched_tokens=budget, max_num_seqs=seqs) as llm:
        runs = _workload(llm)
        stats = llm.engine.scheduler.blocks.stats
        counters = llm.engine.scheduler.counters
    for outs, ref in zip(runs, reference, strict=True):
        _same(outs, ref)
    samples = [c.token_ids for c in runs[0][0].outputs]
    assert len({tuple(t) for t in samples}) > 1, "seeded samples differ from each other"
    prompt_tokens = 2 * 4 * sum(map(len, PROMPTS)) + sum(map(len, PROMPTS))
    assert stats.queried_tokens == prompt_tokens
    # first run: 3 of 4 samples share each prompt; the second also hits the cache
    assert stats.hit_tokens >= 3 * sum(map(len, PROMPTS)) * 2 + 12
    assert counters.prefill_tokens == prompt_tokens - stats.hit_tokens
    if budget == 7:
        assert counters.steps > 45 // 7, "the long prompt was prefilled in chunks"


def test_eviction_under_a_tiny_kv_budget_changes_nothing(llama_dir, reference):
    with LLM(llama_dir, block_size=BS, kv_cache_memory=_bytes_for_blocks(llama_dir, 40)) as llm:
        runs = _workload(llm)
        assert llm.engine.scheduler.blocks.num_blocks == 40
        assert llm.engine.scheduler.num_preemptions > 0
    for outs, ref in zip(runs, reference, strict=True):
        _same(outs, ref)


def _bytes_for_blocks(path: str, num_blocks: int) -> int:
    config = transformers.AutoConfig.from_pretrained(path)
    head_dim = config.hidden_size // config.num_attention_heads
    per_block = 2 * config.num_hidden_layers * BS * config.num_key_value_heads * head_dim * 4
    return per_block * num_blocks


def test_a_weight_push_invalidates_the_prefix_cache(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    greedy = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    with LLM(trainer_dir, block_size=BS, enable_prefix_caching=False) as ref:
        expected = ref.generate(PROMPTS, greedy)
    with LLM(engine_dir, block_size=BS) as llm:
        blocks = llm.engine.scheduler.blocks
        llm.generate(PROMPTS, greedy)  # fills the cache under the old weights
        hits = blocks.stats.hit_tokens
        llm.generate([PROMPTS[0]], greedy)
        assert blocks.stats.hit_tokens - hits == 12, "3 cached blocks of the old weights"
        WeightSender(trainer.eval(), llm).push(version=1)
        assert blocks.num_cached == 0
        hits = blocks.stats.hit_tokens
        first = llm.generate([PROMPTS[0]], greedy)
        assert blocks.stats.hit_tokens == hits, "a block of the old weights was reused"
        outs = llm.generate(PROMPTS, greedy)
        assert blocks.stats.hit_tokens - hits == 24, "cached again, under the new weights"
        _same(first + outs[1:], expected, tol=1e-4)
        _same(outs, expected, tol=1e-4)
        llm.reset_prefix_cache()
        assert blocks.num_cached == 0


def test_long_prompt_and_running_decodes_interleave(llama_dir):
    with LLM(llama_dir, block_size=BS, max_num_batched_tokens=8, max_num_seqs=8) as llm:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        running = engine.admission.make_sequences("a", [1, 2, 3], params)
        engine.add(running)
        engine.step()
        long = engine.admission.make_sequences("b", list(range(100, 140)), params)
        engine.add(long)
        for step in range(5):
            before = running[0].num_output_tokens
            engine.step()
            assert running[0].num_output_tokens == before + 1, f"decode stalled at step {step}"
        assert long[0].num_output_tokens == 0 and 0 < long[0].num_cached_tokens < 40
        while engine.has_unfinished():
            engine.step()
    with LLM(llama_dir, block_size=BS, enable_prefix_caching=False) as ref:
        expected = ref.generate([list(range(100, 140))], params)
    assert long[0].output_token_ids == expected[0].outputs[0].token_ids


def test_pipeline_with_chunks_in_flight_and_preemption(llama_dir, reference):
    """PP=2 keeps two steps in flight; tiny budgets force chunks and preemption."""
    kv = _bytes_for_blocks(llama_dir, 10)  # per rank: each stage holds half the layers
    with LLM(
        llama_dir,
        pipeline_parallel_size=2,
        block_size=BS,
        max_num_batched_tokens=9,
        max_num_seqs=9,
        kv_cache_memory=kv,
    ) as llm:
        runs = _workload(llm)
        stats = llm.engine.stats()
        assert stats.peak_steps_in_flight == 2 and stats.kv_blocks_total == 20
        assert llm.engine.scheduler.num_preemptions > 0
    for outs, ref in zip(runs, reference, strict=True):
        _same(outs, ref)


def test_random_aborts_with_shared_blocks_leak_nothing(llama_dir):
    """Requests of n samples over shared, cached and chunked prompts in a KV cache small enough
    to preempt, aborted at random points (unforked samples, parents mid-prefill, forked
    samples): every block comes back and the survivors match a run without sharing."""
    import random

    rng = random.Random(3)
    prompts = [SHARED * rng.randint(1, 3) + [rng.randrange(100, 400)] for _ in range(10)]
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    kv = _bytes_for_blocks(llama_dir, 24)
    with LLM(
        llama_dir, block_size=BS, max_num_batched_tokens=11, max_num_seqs=11, kv_cache_memory=kv
    ) as llm:
        engine = llm.engine
        make = engine.admission.make_sequences
        requests = [make(str(i), p, params) for i, p in enumerate(prompts)]
        for seqs in requests:
            engine.add(seqs)
        aborted = set()
        while engine.has_unfinished():
            engine.step()
            if rng.random() < 0.3:
                i = rng.randrange(len(requests))
                victims = rng.sample(requests[i], rng.randint(1, 3))
                engine.abort(victims)
                aborted.update(s.seq_id for s in victims)
        blocks = engine.scheduler.blocks
        assert blocks.num_free == blocks.num_blocks, "a block leaked"
        assert engine.scheduler.num_unfinished == 0 and 0 < len(aborted) < 30
        assert engine.scheduler.num_preemptions > 0
    survivors = [(i, s) for i, seqs in enumerate(requests) for s in seqs if s.seq_id not in aborted]
    with LLM(llama_dir, block_size=BS, enable_prefix_caching=False) as ref:
        expected = ref.generate(prompts, params)
    for i, seq in survivors:
        assert seq.output_token_ids == expected[i].outputs[seq.index].token_ids
        assert seq.finish_reason == "length"

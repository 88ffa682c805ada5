"""WeightSender pushes a trainer model into a live engine, in place, over shared memory."""

import gc
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import transformers

from support.trainers import run_trainer
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]


def _trainer(path: str) -> torch.nn.Module:
    """The "trainer": transformers' model of another random init (different weights)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _served(llm, ids):
    """The engine's logits for ``ids`` on the weights it serves."""
    return llm.score([ids], logprobs=False)[0]


def _data_ptrs(model) -> dict[str, int]:
    """Where each parameter's storage lives (a push in place keeps it)."""
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def _staging_inodes() -> set[int]:
    """The inodes of the shm sender's staging memory this process holds open: memfds named
    "tandem-staging" (`tandem.exchange.transports.shm`), as /proc/self/fd lists them (the
    memfd's own descriptor, and one per mapping: an in-process engine's receiver maps it too)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:tandem-staging"):
                inodes.add(os.stat(fd).st_ino)
        except FileNotFoundError:  # closed meanwhile (the listing's own descriptor, say)
            pass
    return inodes


@pytest.mark.parametrize(
    ("family", "transport", "mode"),
    [
        ("llama", "shm", "staged"),
        ("qwen2", "shm", "staged"),
        ("gpt2", "shm", "staged"),
        ("llama", "shm", "in_place"),
        ("gpt2", "shm", "in_place"),
        ("llama", "dist", "staged"),
        ("gpt2", "dist", "staged"),
    ],
)
def test_push_into_single_process_engine_in_place(model_factory, family, transport, mode):
    engine_dir, trainer_dir = model_factory(family), model_factory(family, seed=1)
    trainer = _trainer(trainer_dir)
    with LLM(engine_dir) as llm:
        before = llm.apply_model(_data_ptrs)
        assert (_served(llm, PROMPTS[0]) - _logits(trainer, PROMPTS[0])).abs().max() > 1e-2
        stats = WeightSender(trainer, llm, transport=transport, mode=mode).push(version=7)
        assert llm.weight_version == 7 and stats.version == 7 and stats.transport == transport
        assert stats.bytes_sent == stats.bytes_moved == stats.bytes_needed > 0
        assert llm.apply_model(_data_ptrs) == before
        for ids in PROMPTS:
            assert (_served(llm, ids) - _logits(trainer, ids)).abs().max() <= 1e-4
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
        assert out[0].weight_version == 7


@pytest.mark.parametrize(
    ("transport", "mode"), [("shm", "staged"), ("shm", "in_place"), ("dist", "staged")]
)
def test_push_into_tensor_parallel_engine(model_factory, transport, mode):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = _trainer(trainer_dir)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(trainer_dir) as reference:
        expected = reference.generate(PROMPTS, params)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        stats = WeightSender(trainer, llm, transport=transport, mode=mode).push(version=3)
        assert stats.bytes_sent == stats.bytes_needed
        got = llm.generate(PROMPTS, params)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert (
            max(
                abs(a - b)
                for a, b in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True)
            )
            <= 1e-5
        )
        assert g.weight_version == 3


def test_shm_staging_memory_is_kept_between_pushes_and_never_serves_stale_bytes(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = _trainer(trainer_dir)
    shm_before = set(Path("/dev/shm").iterdir())
    with LLM(engine_dir) as llm:
        others = _staging_inodes()  # any an earlier test left to the garbage collector
        sender = WeightSender(trainer, llm, transport="shm")
        staging = []
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():  # new weights for the second push, same layout
                    for p in trainer.parameters():
                        p.mul_(1.5)
            sender.push(version=version)
            staging.append(_staging_inodes() - others)
            for ids in PROMPTS:
                assert (_served(llm, ids) - _logits(trainer, ids)).abs().max() <= 1e-4
        assert staging[0] and staging[0] == staging[1]  # the same memfd: no new pages
        sender.close()
    # the engine's mapping of it (its receiver's, in this process) goes with the engine, its
    # exchange server's threads ending; the sender (``sender`` still refers to it) holds none
    # after close
    deadline = time.monotonic() + 10
    while _staging_inodes() - others and time.monotonic() < deadline:
        gc.collect()  # a descriptor closes with its mapping (see memory.SharedMemory)
        time.sleep(0.05)
    assert not _staging_inodes() - others, "close kept the staging memory"
    assert set(Path("/dev/shm").iterdir()) == shm_before  # nameless: nothing created there


def _check_matches_transformers(llm, trainer_dir: str, version: int) -> None:
    reference = _trainer(trainer_dir)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    for out in llm.generate(PROMPTS, params):
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        logp = torch.log_softmax(_logits(reference, ids), dim=-1)
        n = len(out.prompt_token_ids)
        expected = logp[n - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert c.token_ids == logp[n - 1 : -1].argmax(-1).tolist()
        assert (torch.tensor(c.logprobs) - expected).abs().max() <= 1e-4
        assert out.weight_version == version


@pytest.mark.parametrize(
    ("transport", "mode"),
    [
        ("shm", "staged"),
        pytest.param("shm", "in_place", marks=pytest.mark.slow),
        pytest.param("dist", "staged", marks=pytest.mark.slow),
        ("dist", "in_place"),
    ],
)
def test_fsdp2_trainer_processes_push_into_tp2_engine(model_factory, transport, mode):
    """2 FSDP2 ranks (uneven vocab shards) -> engine TP=2, each transport and mode."""
    engine_dir = model_factory("llama", vocab_size=509)
    trainer_dir = model_factory("llama", seed=1, vocab_size=509)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        assert run_trainer(trainer_dir, llm.exchange_address, 5, transport, mode) == [0, 0]
        assert llm.weight_version == 5
        _check_matches_transformers(llm, trainer_dir, 5)


# dist: also tests/integration/engine/test_faults.py's trainer killed mid-push
@pytest.mark.parametrize("transport", ["shm", pytest.param("dist", marks=pytest.mark.slow)])
def test_trainer_killed_mid_push_keeps_old_weights_then_next_push_lands(model_factory, transport):
    engine_dir = model_factory("llama", vocab_size=509)
    trainer_dir = model_factory("llama", seed=1, vocab_size=509)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        before = llm.generate(PROMPTS, params)
        codes = run_trainer(trainer_dir, llm.exchange_address, 1, transport, die=True)
        assert codes == [3, 17]  # rank 0 told the push failed; rank 1 died
        assert llm.weight_version == 0
        after = llm.generate(PROMPTS, params)
        assert [o.outputs[0].logprobs for o in after] == [o.outputs[0].logprobs for o in before]
        assert run_trainer(trainer_dir, llm.exchange_address, 2, transport) == [0, 0]
        _check_matches_transformers(llm, trainer_dir, 2)
    assert not list(Path("/dev/shm").glob("tandem-*")), "a staged segment was left behind"


def test_push_during_generation_lands_between_steps(model_factory):
    """Async RL: a push between decode steps; the requests go on with the new weights (over
    the keys/values the old ones cached) and report both versions."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = _trainer(trainer_dir)
    prompts = [[7 + i, 3, 9] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(engine_dir) as llm:
        unchanged = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        engine = llm.engine
        make = engine.admission.make_sequences
        seqs = [s for i, ids in enumerate(prompts) for s in make(str(i), ids, params)]
        engine.add(seqs)
        for _ in range(5):
            engine.step()
        WeightSender(trainer, llm).push(version=1)  # the engine is between two steps
        while engine.has_unfinished():
            engine.step()
    for seq, old in zip(seqs, unchanged, strict=True):
        assert seq.weight_versions == {0, 1}
        assert seq.output_token_ids[:5] == old[:5]  # before the push: the old weights
    assert any(s.output_token_ids[5:] != old[5:] for s, old in zip(seqs, unchanged, strict=True))


# dist: also tests/integration/engine/test_faults.py's torn in-place push
@pytest.mark.parametrize("transport", ["shm", pytest.param("dist", marks=pytest.mark.slow)])
def test_in_place_push_broken_midway_refuses_requests_until_a_complete_push(
    model_factory, transport
):
    engine_dir = model_factory("llama", vocab_size=509)
    trainer_dir = model_factory("llama", seed=1, vocab_size=509)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        address = llm.exchange_address
        codes = run_trainer(trainer_dir, address, 1, transport, "in_place", die=True)
        assert codes == [3, 17]
        with pytest.raises(WeightSyncError, match="refused until a complete push"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=2))
        assert run_trainer(trainer_dir, address, 2, transport, "in_place") == [0, 0]
        _check_matches_transformers(llm, trainer_dir, 2)


def test_silent_peers_on_the_exchange_port_do_not_hold_up_a_push(model_factory):
    """Each connection says hello on its own thread: strangers that connect and say nothing
    (each could hold a handshake for 30 s) do not delay a trainer."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir) as llm:
        host, port = llm.exchange_address.split("/")[0].rsplit(":", 1)
        silent = [socket.create_connection((host, int(port))) for _ in range(3)]
        try:
            start = time.monotonic()
            WeightSender(_trainer(trainer_dir), llm).push(version=1)
            assert time.monotonic() - start < 20  # not 3 x 30 s of handshake timeouts
            assert llm.weight_version == 1
        finally:
            for s in silent:
                s.close()

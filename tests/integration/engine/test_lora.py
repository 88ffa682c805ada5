"""LoRA adapters served in mixed batches and pushed alone.

Every request with an adapter equals the merged PEFT model (`merge_and_unload` in transformers)
within 1e-4 in float32, whatever else its batch holds (other adapters, the base model), under TP
and PP; the prefix cache never serves one adapter's keys/values to another; an adapter pushed
from a PEFT trainer (plain or FSDP2-sharded) lands as exactly its A and B tensors, nothing else
moves, and keeps its last ``keep_versions`` versions; bad adapters are refused by name and
leave what serves untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.faulty_writes import faulty_sender, shifted
from support.lora_refs import greedy, merged, peft_model, save_adapter
from support.paths import SUPPORT, rendezvous
from tandem import LLM, LoRAError, LoRARequest, LoRASlotsFull, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.transports.base import SenderHalf

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8, 41, 7, 66, 12, 90, 4]]
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
TOL = 1e-4


@pytest.fixture(scope="module")
def lora(llama_dir, tmp_path_factory):
    """Two adapters unlike each other (rank 4 on every module, alpha 8; rank 8 on q and v
    with rslora, alpha 16), saved by PEFT, and their merged models."""
    root = tmp_path_factory.mktemp("adapters")
    a1 = peft_model(llama_dir, 1)
    a2 = peft_model(llama_dir, 2, r=8, alpha=16, targets=("q_proj", "v_proj"), rslora=True)
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return {
        "paths": {"a1": save_adapter(a1, root / "a1"), "a2": save_adapter(a2, root / "a2")},
        "models": {"a1": merged(a1), "a2": merged(a2), None: base.eval()},
        "peft": {"a1": a1, "a2": a2},
    }


def _request(lora, name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, {"a1": 1, "a2": 2}[name], lora["paths"][name])


def _close(got, want, tol: float = TOL) -> None:
    tokens, logprobs = got
    assert tokens == want[0]
    assert max(abs(a - b) for a, b in zip(logprobs, want[1], strict=True)) < tol


def _pairs(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_every_row_of_a_mixed_batch_equals_its_merged_peft_model(llama_dir, lora, tp, pp):
    names = ["a1", "a2", None, "a2", "a1", None]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    with LLM(
        llama_dir,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    ) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=[_request(lora, n) for n in names])
    for out, prompt, name in zip(outs, prompts, names, strict=True):
        _close(_pairs([out])[0], greedy(lora["models"][name], prompt, MAX_TOKENS))
    # the adapters change the output: a test that passes with them ignored proves nothing
    assert _pairs(outs[:1]) != _pairs(outs[2:3]) or PROMPTS[0] != prompts[2]
    base_first = greedy(lora["models"][None], PROMPTS[0], MAX_TOKENS)
    assert greedy(lora["models"]["a1"], PROMPTS[0], MAX_TOKENS)[0] != base_first[0]


def test_a_mixed_batch_equals_each_adapter_run_alone(llama_dir, lora):
    names = ["a1", None, "a2", "a1"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[1]]
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        mixed = _pairs(
            llm.generate(prompts, GREEDY, lora_request=[_request(lora, n) for n in names])
        )
        alone = [
            _pairs(llm.generate([p], GREEDY, lora_request=_request(lora, n)))[0]
            for p, n in zip(prompts, names, strict=True)
        ]
    for got, want in zip(mixed, alone, strict=True):
        _close(got, want, 1e-5)


def test_the_prefix_cache_is_keyed_by_adapter(llama_dir, lora):
    """A prompt of several full blocks computed with a1 is not reused for the base model or
    a2 (their outputs equal their own references), and is reused for a1 again."""
    long_prompt = [(7 * i + 3) % 400 + 5 for i in range(40)]  # 2 full blocks of 16 + 8
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        for name in ("a1", "a2"):  # loading is a push, which empties the prefix cache
            llm.engine.adapters.load(name, lora["paths"][name])
        stats = llm.engine.scheduler.blocks.stats
        order = ["a1", None, "a2", "a1", None]
        hits = []
        for name in order:
            before = stats.hit_tokens
            out = llm.generate([long_prompt], GREEDY, lora_request=_request(lora, name))
            hits.append(stats.hit_tokens - before)
            _close(_pairs(out)[0], greedy(lora["models"][name], long_prompt, MAX_TOKENS))
    assert hits == [0, 0, 0, 32, 32]


def test_an_adapter_from_tensors_in_memory_equals_the_one_from_its_directory(llama_dir, lora):
    from peft import get_peft_model_state_dict

    model = lora["peft"]["a2"]
    tensors = get_peft_model_state_dict(model)
    memory = LoRARequest("mem", 9, lora_tensors=tensors, lora_config=model.peft_config["default"])
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        from_memory = _pairs(llm.generate(PROMPTS, GREEDY, lora_request=memory))
        from_dir = _pairs(llm.generate(PROMPTS, GREEDY, lora_request=_request(lora, "a2")))
        assert [a.name for a in llm.engine.adapters.loaded()] == ["a2", "mem"]
    assert from_memory == from_dir


def test_an_adapter_push_sends_only_the_adapter_and_serves_its_latest_version(llama_dir, lora):
    trainer = peft_model(llama_dir, 3)
    adapter_bytes = sum(p.numel() * 4 for n, p in trainer.named_parameters() if "lora_" in n)
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        base = _pairs(llm.generate(PROMPTS, GREEDY))
        # an SFT adapter first, from its directory; the trainer's pushes replace it
        assert llm.engine.adapters.load("policy", lora["paths"]["a1"]).path is not None
        sender = WeightSender(trainer, llm, lora_name="policy")
        stats = sender.push(version=7)
        assert stats.bytes_needed == stats.bytes_moved == adapter_bytes
        assert llm.weight_version == 0  # the base weights did not move
        policy = LoRARequest("policy", 123)
        for prompt, got in zip(
            PROMPTS, _pairs(llm.generate(PROMPTS, GREEDY, lora_request=policy)), strict=True
        ):
            _close(got, greedy(merged(trainer), prompt, MAX_TOKENS))
        with torch.no_grad():  # a training step's worth of change
            for name, p in trainer.named_parameters():
                if "lora_B" in name:
                    p.add_(0.25)
        assert sender.push().version == 8
        (latest,) = llm.engine.adapters.loaded()
        assert (latest.name, latest.version, latest.path) == ("policy", 8, None)  # pushed
        outs = llm.generate(PROMPTS, GREEDY, lora_request=policy)
        assert [(o.lora_request, o.lora_version) for o in outs] == [(policy, 8)] * 2
        for prompt, got in zip(PROMPTS, _pairs(outs), strict=True):
            _close(got, greedy(merged(trainer), prompt, MAX_TOKENS))
        assert _pairs(llm.generate(PROMPTS, GREEDY)) == base


def test_keep_versions_keeps_the_last_n_versions_in_their_slots(llama_dir):
    """With keep_versions=2 a push lands beside the previous version, whose slot keeps its
    tensors (a request pinned to it finishes on it); the third replaces the oldest."""
    trainer = peft_model(llama_dir, 4)
    with LLM(llama_dir, enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        registry = llm.engine.adapters.registry
        [stacks] = llm.apply_model(
            lambda model: [m for m in model.modules() if type(m).__name__ == "LoRAStack"]
        )
        sender = WeightSender(trainer, llm, lora_name="policy", keep_versions=2)
        snapshots = {}
        for version in (1, 2, 3):
            with torch.no_grad():
                for name, p in trainer.named_parameters():
                    if "lora_A" in name:
                        p.mul_(1.5)
            sender.push(version=version)
            slot = registry.latest("policy").slot
            rows = slice(slot * stacks[0].width, (slot + 1) * stacks[0].width)
            snapshots[version] = (slot, stacks[0].lora_a[rows].clone())
            held = [(a.version, a.slot) for a in registry.versions("policy")]
            assert [v for v, _ in held] == ([1] if version == 1 else [version - 1, version])
        slot2, a2 = snapshots[2]
        rows2 = slice(slot2 * stacks[0].width, (slot2 + 1) * stacks[0].width)
        assert torch.equal(stacks[0].lora_a[rows2], a2)  # version 2 untouched by version 3
        assert snapshots[3][0] == snapshots[1][0] != slot2  # 3 took the slot of 1
        out = llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("policy", 1))
        _close(_pairs(out)[0], greedy(merged(trainer), PROMPTS[0], MAX_TOKENS))


def test_an_adapter_push_from_a_two_rank_fsdp2_peft_trainer_lands_exactly(
    llama_dir, lora, tmp_path
):
    """FSDP2 shards every A and B by rows over two trainer ranks (DTensors); the engine at
    TP=2 takes each box from the rank that holds it and serves the merged model."""
    script = SUPPORT / "fsdp_peft_trainer.py"
    store = rendezvous()
    with LLM(
        llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, tensor_parallel_size=2
    ) as llm:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(r),
                    store,
                    llama_dir,
                    lora["paths"]["a1"],
                    llm.exchange_address,
                ],
                env=env,
            )
            for r in range(2)
        ]
        try:
            codes = [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                p.kill()
        assert codes == [0, 0]
        outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("policy", 1))
    for prompt, got in zip(PROMPTS, _pairs(outs), strict=True):
        _close(got, greedy(lora["models"]["a1"], prompt, MAX_TOKENS))


def test_a_wrong_copy_of_an_adapter_is_rejected_and_its_last_version_serves(llama_dir, monkeypatch):
    trainer = peft_model(llama_dir, 5)
    with LLM(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        sender = WeightSender(trainer, llm, lora_name="policy")
        sender.push(version=1)
        policy = LoRARequest("policy", 1)
        before = _pairs(llm.generate(PROMPTS, GREEDY, lora_request=policy))
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5)
        with monkeypatch.context() as m:
            m.setattr(SenderHalf, "write_box", faulty_sender(shifted))
            with pytest.raises(
                WeightSyncError,
                match="checksum mismatch.*versions loaded "
                "before keep serving|versions loaded before keep serving.*"
                "checksum mismatch",
            ):
                sender.push(version=2)
        assert llm.engine.adapters.registry.latest("policy").version == 1
        assert _pairs(llm.generate(PROMPTS, GREEDY, lora_request=policy)) == before


def test_bad_adapters_are_refused_by_name_and_nothing_runs(
    llama_dir, lora, tmp_path, model_factory
):
    wide = save_adapter(peft_model(llama_dir, 6, r=16), tmp_path / "wide")
    dora_dir = save_adapter(peft_model(llama_dir, 7), tmp_path / "dora")
    config = Path(dora_dir, "adapter_config.json")
    config.write_text(config.read_text().replace('"use_dora": false', '"use_dora": true'))
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        with pytest.raises(LoRAError, match="rank 16 is above max_lora_rank 8"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("wide", 3, wide))
        with pytest.raises(LoRAError, match="use_dora"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("dora", 4, dora_dir))
        with pytest.raises(LoRAError, match="'nope' is not loaded"):
            llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("nope", 5))
        third = save_adapter(peft_model(llama_dir, 9), tmp_path / "third")
        three = [_request(lora, "a1"), _request(lora, "a2"), LoRARequest("a3", 3, third)]
        with pytest.raises(LoRASlotsFull, match="all max_loras=2 slots"):  # 3 in one call
            llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=three)
        assert llm.engine.scheduler.has_unfinished() is False
        assert sorted(a.name for a in llm.engine.adapters.loaded()) == ["a1", "a2"]
        _close(
            _pairs(llm.generate(PROMPTS[:1], GREEDY, lora_request=_request(lora, "a1")))[0],
            greedy(lora["models"]["a1"], PROMPTS[0], MAX_TOKENS),
        )
    with LLM(llama_dir) as llm:
        with pytest.raises(LoRAError, match="enable_lora"):
            llm.generate(PROMPTS, GREEDY, lora_request=_request(lora, "a1"))
    with pytest.raises(LoRAError, match="no layers LoRA adapts"):
        LLM(model_factory("gpt2"), enable_lora=True)


def test_three_adapters_share_two_slots_across_calls(llama_dir, lora, tmp_path):
    """An idle adapter read from a directory gives its slot to a new one and comes back from
    its directory when asked for again."""
    third = peft_model(llama_dir, 8)
    a3 = save_adapter(third, tmp_path / "a3")
    with LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        for name, request in [
            ("a1", _request(lora, "a1")),
            ("a2", _request(lora, "a2")),
            ("a3", LoRARequest("a3", 3, a3)),
            ("a1", _request(lora, "a1")),
        ]:
            out = llm.generate(PROMPTS[:1], GREEDY, lora_request=request)
            model = merged(third) if name == "a3" else lora["models"][name]
            _close(_pairs(out)[0], greedy(model, PROMPTS[0], MAX_TOKENS))
        assert sorted(a.name for a in llm.engine.adapters.loaded()) == ["a1", "a3"]
        llm.engine.adapters.unload("a3")
        assert [a.name for a in llm.engine.adapters.loaded()] == ["a1"]

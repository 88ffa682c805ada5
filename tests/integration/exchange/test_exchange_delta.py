"""Delta pushes (`sender.push(version, delta=...)`) from a float32 trainer taking AdamW steps
into a bfloat16 engine: after every push the engine's parameters equal the trainer's cast to
bfloat16 (the reference: transformers' model, cast), whether the push went as a delta or
dense; a delta moves a fraction of the bytes; an engine whose weights are not the delta's base
gets a dense push; and a delta that does not reproduce the trainer's whole boxes (a payload
lost, the wrong base, a stale shadow) is rejected with the old weights serving."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

import pytest
import torch
import transformers

from support.paths import SUPPORT, rendezvous
from support.trainers import FSDP_TRAINER, start_rank, wait_ranks
from support.waits import until
from tandem import LLM, SamplingParams
from tandem.engine.engine_target import EngineTarget
from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.delta import AUTO_RETRY_AFTER, Shadow

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)


class Trainer:
    """A float32 model and its AdamW at an RL learning rate; `step` takes one update."""

    def __init__(self, path: str, lr: float = 1e-5):
        torch.manual_seed(0)
        self.path = path
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self) -> None:
        ids = torch.randint(0, 100, (2, 12))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def cast(self) -> dict[str, torch.Tensor]:
        """Its weights as a bfloat16 engine holds them: loaded from its checkpoint."""
        with tempfile.TemporaryDirectory() as out:
            self.model.save_pretrained(out)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(self.path, name), out)
            with LLM(out, dtype="bfloat16") as llm:
                return _live(llm)


def _live(llm) -> dict[str, torch.Tensor]:
    [params] = llm.apply_model(lambda m: {k: p.detach().clone() for k, p in m.named_parameters()})
    return params


def _assert_holds(llm, expected: dict[str, torch.Tensor]) -> None:
    live = _live(llm)
    assert set(expected) == set(live)
    bad = [k for k, v in expected.items() if not torch.equal(live[k], v)]
    assert not bad, f"{len(bad)} parameters differ, e.g. {bad[:3]}"


def _outputs(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    ("transport", "mode"),
    [
        ("shm", "staged"),
        ("shm", "in_place"),
        ("dist", "staged"),
        ("dist", "in_place"),
        ("mooncake", "staged"),
    ],
)
def test_delta_pushes_land_the_trainers_weights_moving_a_fraction_of_the_bytes(
    llama_dir, transport, mode
):
    trainer = Trainer(llama_dir)
    with LLM(llama_dir, dtype="bfloat16") as llm:
        sender = WeightSender(trainer.model, llm, transport=transport, mode=mode)
        first = sender.push(version=1, delta=True)
        assert not first.delta and first.why_dense == "no push of this sender has landed yet"
        assert first.bytes_moved == first.bytes_needed
        assert sender.shadow.nbytes == first.bytes_needed  # one rank: its boxes, in bf16
        for version in (2, 3):
            trainer.step()
            stats = sender.push(version=version, delta=True)
            assert stats.delta and stats.why_dense is None
            assert 0 < stats.bytes_moved < 0.5 * stats.bytes_needed
            assert llm.weight_version == version
        _assert_holds(llm, trainer.cast())  # each push checked its boxes whole; this, all
        sender.close()


def test_auto_sends_a_delta_only_where_it_pays(llama_dir, model_factory):
    """Over dist (a link slower than memory) "auto", the default, sends deltas where they
    carry at most half the dense bytes, else dense (and then a few pushes dense without
    encoding before trying again); over shm (memory speed) it stays dense."""
    trainer = Trainer(llama_dir)
    other = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=1), dtype=torch.float32
    )
    with LLM(llama_dir, dtype="bfloat16") as llm:
        sender = WeightSender(trainer.model, llm, transport="dist")
        sender.push(version=1)
        trainer.step()
        assert sender.push(version=2).delta
        with torch.no_grad():  # every weight moves: a delta would carry more than dense
            for p, q in zip(trainer.model.parameters(), other.parameters(), strict=True):
                p.copy_(q)
        stats = sender.push(version=3)
        assert not stats.delta and "of the dense bytes" in stats.why_dense
        assert stats.bytes_moved == stats.bytes_needed and stats.density > 0.5
        _assert_holds(llm, trainer.cast())
        retried = [sender.push() for _ in range(AUTO_RETRY_AFTER)]
        assert [s.density for s in retried] == [None] * AUTO_RETRY_AFTER  # nothing encoded
        trainer.step()
        assert sender.push().delta  # tried again: small steps pay
        off = sender.push(delta=False)
        assert not off.delta and off.why_dense is None
        shm = WeightSender(trainer.model, llm, transport="shm")
        shm.push()
        trainer.step()
        stats = shm.push()
        assert not stats.delta and stats.why_dense is None and stats.density is None
        assert not shm.push(delta=True).delta  # asked for: the first keeps a shadow
        trainer.step()
        assert shm.push(delta=True).delta  # then sent
        _assert_holds(llm, trainer.cast())


def test_an_engine_not_at_the_senders_base_gets_a_dense_push(llama_dir, model_factory):
    trainer = Trainer(llama_dir)
    other = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=1), dtype=torch.float32
    )
    with LLM(llama_dir, dtype="bfloat16") as llm:
        sender = WeightSender(trainer.model, llm)
        sender.push(version=1, delta=True)
        WeightSender(other, llm).push(version=2, delta=False)  # another trainer's weights
        trainer.step()
        stats = sender.push(version=3, delta=True)
        assert not stats.delta and "does not hold the weights of push" in stats.why_dense
        _assert_holds(llm, trainer.cast())

        for changed_behind in (llm.reload_weights, lambda: (llm.sleep(2), llm.wake())):
            trainer.step()
            assert sender.push(delta=True).delta  # at its base again after the dense push
            changed_behind()
            trainer.step()
            stats = sender.push(delta=True)
            assert not stats.delta and "weights of another origin" in stats.why_dense
            _assert_holds(llm, trainer.cast())


def _lose_one_box(monkeypatch) -> None:
    """The values of one box's payload never arrive (read as zeros: the frame carrying them
    was lost), after the CRC32s were taken."""
    encode = Shadow.encode

    def lossy(self, items, tensors, verify):
        encoded = encode(self, items, tensors, verify)
        for item, e in zip(items, encoded, strict=True):
            if e.box.changed and e.box.encoding != "dense":
                n = math.prod(item.box_shape)
                head = -(-n // 8) if e.box.encoding == "bitmap" else 4 * e.box.changed
                e.payload[-(-head // 8) * 8 :].zero_()
                return encoded
        raise AssertionError("no sparse box")

    monkeypatch.setattr(Shadow, "encode", lossy)


def _wrong_base(monkeypatch, sender, llm, model_factory) -> None:
    """Another trainer's weights land, and the engine (wrongly) still names the sender's
    push as its base."""
    base = sender.shadow.base
    other = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=1), dtype=torch.float32
    )
    WeightSender(other, llm).push(delta=False)
    monkeypatch.setattr(EngineTarget, "weight_base", property(lambda self: base))


def _stale_shadow(monkeypatch, sender, trainer) -> None:
    """The sender's shadow of one box already holds the new values: it sees nothing changed
    there, while the engine holds the old ones."""
    new = {k: p.detach().to(torch.bfloat16) for k, p in trainer.model.named_parameters()}
    for item, box in zip(sender.shadow.items, sender.shadow.boxes, strict=True):
        if not torch.equal(box, item.src.view(new[item.key])):
            box.copy_(item.src.view(new[item.key]))
            return
    raise AssertionError("no box changed")


@pytest.mark.parametrize("fault", ["lost payload", "wrong base", "stale shadow"])
@pytest.mark.parametrize(("transport", "mode"), [("shm", "staged"), ("dist", "in_place")])
def test_a_delta_that_does_not_reproduce_the_trainers_boxes_is_rejected_and_the_old_weights_serve(
    llama_dir, model_factory, monkeypatch, fault, transport, mode
):
    trainer = Trainer(llama_dir)
    with LLM(llama_dir, dtype="bfloat16") as llm:
        sender = WeightSender(trainer.model, llm, transport=transport, mode=mode)
        sender.push(version=1, delta=True)
        trainer.step()
        with monkeypatch.context() as m:
            if fault == "lost payload":
                _lose_one_box(m)
            elif fault == "wrong base":
                _wrong_base(m, sender, llm, model_factory)
            before, outputs, served = _live(llm), _outputs(llm), llm.weight_version
            if fault == "stale shadow":
                _stale_shadow(m, sender, trainer)
            with pytest.raises(WeightSyncError, match="with its delta applied"):
                sender.push(version=5, delta=True)
            assert llm.weight_version == served
            _assert_holds(llm, before)  # every applied element put back
            assert _outputs(llm) == outputs
        stats = sender.push(version=6, delta=True)  # after a failure: dense, and right
        assert not stats.delta
        _assert_holds(llm, trainer.cast())


@pytest.mark.parametrize(
    ("engine", "transport", "mode"),
    [
        ({"tensor_parallel_size": 2}, "shm", "staged"),
        ({"pipeline_parallel_size": 2}, "dist", "in_place"),
    ],
)
def test_an_fsdp2_trainer_pushes_deltas_into_a_tp_or_pp_engine(
    llama_dir, tmp_path, engine, transport, mode, monkeypatch
):
    """support/delta_trainer.py: 2 FSDP2 ranks, AdamW at lr 1e-5, 3 pushes; the engine then
    decodes, log-probs bit for bit, what the same engine does that loaded the trainer's final
    checkpoint."""
    monkeypatch.setenv("TANDEM_GEMM", "gemv")  # both engines' ranks on one decode kernel
    with LLM(llama_dir, dtype="bfloat16", **engine) as llm:
        argv = [
            rendezvous(),
            llama_dir,
            llm.exchange_address,
            "3",
            transport,
            mode,
            str(tmp_path),
        ]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        procs = [
            start_rank(SUPPORT / "delta_trainer.py", [str(r), *argv], env, FSDP_TRAINER)
            for r in range(2)
        ]
        assert wait_ranks(procs, 180) == [0, 0]
        pushes = json.loads((tmp_path / "pushes.json").read_text())
        assert [p["delta"] for p in pushes] == [False, True, True]
        for p in pushes[1:]:
            assert p["bytes_moved"] == p["bytes_sent"] < 0.5 * p["bytes_needed"]
        assert llm.weight_version == 3
        got = _decoded(llm)
    with LLM(str(tmp_path / "ckpt"), dtype="bfloat16", **engine) as ref:
        assert got == _decoded(ref)


def _decoded(llm) -> list[tuple[list[int], list[float]]]:
    prompts = [[5, 9, 33, 2, 17], [100, 3, 8], [7] * 20, list(range(40, 70))]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("transport", ["dist", "shm"])
def test_a_fleet_takes_one_delta_relayed_to_every_replica(
    llama_dir, tmp_path, transport, monkeypatch
):
    """A fleet of 3: the trainer sends the delta once (dist: relayed replica to replica; shm:
    every replica reads the one staging); each replica checks its whole boxes. A replica that
    joins holds a peer's copy of the trainer's push: the next delta reaches it too. A replica
    whose weights came from another push is left out of the delta (the others take it) and
    heals from a peer, after which deltas reach it again. Rolling deltas (shm) commit wave by
    wave, and the next is a delta too."""
    # the reference below is a fleet too, and every replica runs its decode matmuls on the one
    # kernel: each process probes its own (`tandem.layers.gemm_choice`), and oneDNN's bfloat16
    # sums round otherwise than the GEMV kernel's (by 1e-3 in log-prob: one AdamW step's size)
    monkeypatch.setenv("TANDEM_GEMM", "gemv")
    trainer = Trainer(llama_dir)
    with LLM(llama_dir, dtype="bfloat16", data_parallel_size=3) as llm:
        sender = WeightSender(trainer.model, llm, transport=transport)
        dense = sender.push(version=1, delta=True)
        trainer.step()
        stats = sender.push(version=2, delta=True)
        assert stats.delta and stats.bytes_moved < 0.5 * dense.bytes_moved
        assert [r["version"] for r in llm.fleet_state()] == [2, 2, 2]
        assert [r.state for r in stats.replicas] == ["committed"] * 3
        if transport == "dist":  # the trainer's egress: one copy, passed on by the replicas
            assert sum(r.bytes_relayed for r in stats.replicas) == 2 * stats.bytes_moved
        got = _decoded(llm)
        if transport == "dist":
            llm.add_replica()
            trainer.step()
            stats = sender.push(version=3, delta=True)
            assert stats.delta and [r.state for r in stats.replicas] == ["committed"] * 4
            # the same weights, pushed into replica 3 alone by another sender: another base
            other = llm.fleet.engines[3].target.exchange_server().address
            WeightSender(trainer.model, other).push(version=3, rollback=True, delta=False)
            trainer.step()
            stats = sender.push(version=4, delta=True)
            assert stats.delta and stats.bytes_moved < 0.5 * dense.bytes_moved
            assert [(r.replica, r.state) for r in stats.replicas] == [
                (0, "committed"),
                (1, "committed"),
                (2, "committed"),
            ]
            until(
                "replica 3 healed from a peer",
                lambda: (
                    [(r["state"], r["version"]) for r in llm.fleet_state()] == [("serving", 4)] * 4
                ),
                120,
            )
            trainer.step()
            stats = sender.push(version=5, delta=True)
            assert stats.delta and [r.state for r in stats.replicas] == ["committed"] * 4
        else:  # rolling: each replica checks the delta, holds it, commits it in its wave
            for version in (3, 4):
                trainer.step()
                stats = sender.push(version=version, delta=True, policy="rolling")
                assert stats.delta and stats.wait(timeout=120).committed == [0, 1, 2]
                assert [r["version"] for r in llm.fleet_state()] == [version] * 3
    trainer_at_2 = Trainer(llama_dir)
    trainer_at_2.step()
    with LLM(llama_dir, dtype="bfloat16", data_parallel_size=3) as ref:
        WeightSender(trainer_at_2.model, ref).push(version=2, delta=False)
        want = _decoded(ref)
    assert got == want

"""Fleet updates without stopping the world: rolling waves while the others serve, routing by
version (``max_staleness``), and faults — a replica killed, hung or handed wrong bytes, a
trainer killed before or after every replica staged — each ending with the fleet consistent,
every request answered, and the lost replica healed from a peer (checked against transformers
on the pushed weights, so a replica still holding its checkpoint's weights fails)."""

import os
import signal
import textwrap
import threading
import time

import pytest

from support.fleets import PROMPTS, Load, matches, wait_serving
from support.trainers import hf_model, rolling_trainer, scale
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender
from tandem.fleet.board import ReplicaState

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class _Events:
    """Every state the board is given, with the time (this process's monotonic clock)."""

    def __init__(self, board):
        self.log: list[tuple[float, int, ReplicaState]] = []
        honest = board.set

        def record(replica, state, reason=None):
            self.log.append((time.monotonic(), replica, state))
            honest(replica, state, reason)

        board.set = record

    def committed_at(self) -> list[tuple[float, int]]:
        """(time, replica) each time a wave's replica went back to serving."""
        out, updating = [], set()
        for t, r, state in self.log:
            if state is ReplicaState.UPDATING:
                updating.add(r)
            elif state is ReplicaState.SERVING and r in updating:
                updating.discard(r)
                out.append((t, r))
        return out

    def most_updating_at_once(self) -> int:
        most, now = 0, set()
        for _, r, state in self.log:
            (now.add if state is ReplicaState.UPDATING else now.discard)(r)
            most = max(most, len(now))
        return most


def test_rolling_push_commits_one_wave_at_a_time_while_the_others_serve(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=3, max_staleness=0) as llm:
        events = _Events(llm.fleet.board)
        load = Load(llm, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        time.sleep(0.5)  # requests on every replica
        stats = WeightSender(trainer, llm).push(version=2, policy="rolling", max_unavailable=1)
        # the trainer is answered once every replica holds the version: none committed yet
        assert [r.state for r in stats.replicas] == ["rolling"] * 3
        assert all(r.bytes_in == r.bytes_needed for r in stats.replicas)
        wait_serving(llm, 3)
        deadline = time.monotonic() + 30
        while len(events.committed_at()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        calls = load.stop()
        waves = events.committed_at()
        assert sorted(r for _, r in waves) == [0, 1, 2]
        assert events.most_updating_at_once() == 1  # max_unavailable=1: the others served
        first = waves[0][0]
        outs = [(start, out) for start, call in calls for out in call]
        assert len(outs) >= 6
        for start, out in outs:
            assert len(out.weight_versions) == 1, out.weight_versions  # wave="wait": none mixes
            if start > first:  # max_staleness=0: nothing admitted later ran the old version
                assert out.weight_version == 2, (start - first, out.replica)
        assert [s["version"] for s in llm.fleet_state()] == [2, 2, 2]
        matches(llm, trainer, 2, 3)


def test_keep_waves_say_which_versions_a_request_spans(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        long = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
        box = {}
        thread = threading.Thread(target=lambda: box.update(out=llm.generate(PROMPTS[:2], long)))
        thread.start()
        while not all(e.stats().decode_tokens > 0 for e in llm.fleet.engines):
            time.sleep(0.001)  # both replicas are decoding
        WeightSender(trainer, llm).push(version=3, policy="rolling", max_unavailable=2, wave="keep")
        thread.join(120)
        spans = [o.weight_versions for o in box["out"]]
        # a request running at its wave's commit went on across it (wave="wait" would have
        # drained it first: no request could span two versions), and says so
        assert [0, 3] in spans and all(s in ([0], [0, 3]) for s in spans), spans


def test_in_place_rolling_push_writes_the_first_wave_and_the_rest_from_it(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=3) as llm:
        events = _Events(llm.fleet.board)
        stats = WeightSender(trainer, llm, transport="shm", mode="in_place").push(
            version=5, policy="rolling", max_unavailable=1
        )
        # the trainer wrote one replica's weights, once; the others were written from it
        assert stats.bytes_moved == stats.bytes_needed
        assert [r.replica for r in stats.replicas] == [0]
        wait_serving(llm, 3, version=5)  # the trainer is answered before the later waves
        assert sorted(r for _, r in events.committed_at()) == [1, 2]
        assert events.most_updating_at_once() == 1
        matches(llm, trainer, 5, 3)


def test_a_replica_torn_by_its_in_place_wave_heals_from_a_peer(model_factory, monkeypatch):
    """A later wave of an in-place rolling push is written with one wrong byte (the writer
    copying from the first wave's replica, injected): that replica's live weights are torn, it
    fails its check and is quarantined, then heals from a peer and equals transformers."""
    from tandem.exchange.transports.base import SenderHalf

    honest = SenderHalf.write_box
    flipped = []

    def write_box(self, src, dst):
        crc = honest(self, src, dst)
        if threading.current_thread().name.startswith("tandem-wave-") and not flipped:
            dst.view(-1)[0] += 1.0  # after the CRC of what was read: the receiver must see it
            flipped.append(threading.current_thread().name)
        return crc

    monkeypatch.setattr(SenderHalf, "write_box", write_box)
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=3) as llm:
        events = _Events(llm.fleet.board)
        WeightSender(trainer, llm, transport="shm", mode="in_place").push(
            version=6, policy="rolling", max_unavailable=1
        )
        wait_serving(llm, 3, version=6)  # the torn replica quarantined, then healed
        torn = int(flipped[0].rsplit("-", 1)[1])
        assert (torn, ReplicaState.QUARANTINED) in [(r, s) for _, r, s in events.log]
        assert [s["version"] for s in llm.fleet_state()] == [6, 6, 6]
        matches(llm, trainer, 6, 3)


KILL_IN_VERIFY = """
    import os, signal
    from tandem.exchange import receiver
    from tandem.exchange.settings import PushPhase

    honest = receiver.RankReceiver.handle

    def handle(self, phase, spec, records):
        if phase is PushPhase.VERIFY and spec.version == 7:
            try:  # the first worker to verify dies, here, mid-push
                os.close(os.open(os.environ["TANDEM_TEST_KILL_MARK"], os.O_CREAT | os.O_EXCL))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return honest(self, phase, spec, records)

    receiver.RankReceiver.handle = handle
"""


def test_a_replica_killed_mid_push_is_quarantined_and_healed_from_a_peer(
    model_factory, tmp_path, monkeypatch
):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(KILL_IN_VERIFY))
    monkeypatch.syspath_prepend(str(tmp_path))  # the replicas' workers start with it
    monkeypatch.setenv("TANDEM_TEST_KILL_MARK", str(tmp_path / "killed"))
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        start = time.monotonic()
        stats = WeightSender(trainer, llm).push(version=7)
        assert time.monotonic() - start < 5  # quarantined at once, not after a timeout
        assert (tmp_path / "killed").exists()
        lost = stats.failed
        assert len(lost) == 1 and "exited" in next(iter(lost.values())), stats.replicas
        (kept,) = [r.replica for r in stats.replicas if r.state == "committed"]
        assert llm.fleet_state()[kept]["version"] == 7
        outs = llm.generate(PROMPTS, GREEDY)  # answered meanwhile, on the live replica
        assert all(o.weight_version == 7 for o in outs)
        wait_serving(llm, 2)  # restarted (reading nothing from disk), then pulled from a peer
        matches(llm, trainer, 7, 2)


def test_a_replica_killed_while_it_receives_over_dist_fails_the_push_within_its_deadline(
    model_factory, tmp_path, monkeypatch
):
    """Over dist the replicas share the push's process group: one dying before it joined
    stops the group forming, so the push fails on every replica when the group's deadline
    passes (none waits forever); the dead one heals from a live peer and the retry lands."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(KILL_IN_VERIFY).replace("PushPhase.VERIFY", "PushPhase.RECEIVE")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TANDEM_TEST_KILL_MARK", str(tmp_path / "killed"))
    with LLM(engine_dir, data_parallel_size=2, push_phase_timeout_s=5) as llm:
        start = time.monotonic()
        proc = rolling_trainer(trainer_dir, llm.exchange_address, 7, "all", "dist")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 3 and "did not form within 5 s" in out, out
        assert time.monotonic() - start < 30
        wait_serving(llm, 2)  # the killed replica, restarted and filled from the other
        assert [s["version"] for s in llm.fleet_state()] == [0, 0]  # one version, the old
        proc = rolling_trainer(trainer_dir, llm.exchange_address, 8, "all", "dist")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "states committed,committed" in out, out
        matches(llm, hf_model(trainer_dir), 8, 2)


def test_a_hung_replica_is_quarantined_past_the_deadline(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=2, push_phase_timeout_s=2) as llm:
        pid = next(w["pid"] for w in llm.worker_locations() if w["replica"] == 1)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        stats = WeightSender(trainer, llm).push(version=2)
        assert time.monotonic() - start < 10
        assert list(stats.failed) == [1] and "within 4 s (push_phase_timeout_s" in stats.failed[1]
        wait_serving(llm, 2)
        matches(llm, trainer, 2, 2)


def test_requests_on_a_replica_that_dies_run_again_on_another(model_factory):
    engine_dir = model_factory("llama")
    with LLM(engine_dir, data_parallel_size=2) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        long = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
        box = {}
        thread = threading.Thread(
            target=lambda: box.update(out=llm.generate(PROMPTS + PROMPTS, long))
        )
        decoded = llm.fleet.engines[1].stats().decode_tokens
        thread.start()
        while llm.fleet.engines[1].stats().decode_tokens == decoded:
            time.sleep(0.001)  # replica 1 is decoding its share
        pid = next(w["pid"] for w in llm.worker_locations() if w["replica"] == 1)
        os.kill(pid, signal.SIGKILL)
        thread.join(120)
        outs = box["out"]
        assert all(len(o.outputs[0].token_ids) == 480 for o in outs)  # none dropped or cut
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert {o.replica for o in outs} == {0}  # the lost replica's ran again on replica 0
        wait_serving(llm, 2)
        again = llm.generate(PROMPTS, GREEDY)
        assert {o.replica for o in again} == {0, 1}
        assert [o.outputs[0].token_ids for o in again] == expected


def test_a_trainer_killed_before_every_replica_staged_leaves_the_old_version(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        before = llm.generate(PROMPTS, GREEDY)
        proc = rolling_trainer(trainer_dir, llm.exchange_address, 4, "before")
        assert proc.wait(120) == 17
        time.sleep(0.5)
        assert [(s["state"], s["version"]) for s in llm.fleet_state()] == [("serving", 0)] * 2
        after = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_a_trainer_gone_after_every_replica_staged_still_rolls_the_version_out(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        for _ in range(5):  # until both replicas hold a request when paused
            start = [e.stats().decode_tokens for e in llm.fleet.engines]
            thread = threading.Thread(target=llm.generate, args=(PROMPTS, long))
            thread.start()
            while not all(
                e.stats().decode_tokens > n for e, n in zip(llm.fleet.engines, start, strict=True)
            ):
                time.sleep(0.001)
            llm.pause("keep")  # each wave drains its requests first: none can commit yet
            if all(e.stats().num_running for e in llm.fleet.engines):
                break  # (under load one replica may finish before the other starts)
            llm.resume()
            thread.join(120)
        proc = rolling_trainer(trainer_dir, llm.exchange_address, 6, "after")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "states rolling,rolling" in out
        assert [s["version"] for s in llm.fleet_state()] == [0, 0]  # the trainer is gone
        llm.resume()
        thread.join(120)
        wait_serving(llm, 2)
        assert [s["version"] for s in llm.fleet_state()] == [6, 6]  # committed without it
        matches(llm, hf_model(trainer_dir), 6, 2)


def test_add_replica_pulls_the_fleets_weights_from_a_peer(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        WeightSender(trainer, llm).push(version=9)
        assert llm.add_replica() == 2
        assert [(s["state"], s["version"]) for s in llm.fleet_state()] == [("serving", 9)] * 3
        # the checkpoint on disk holds other weights: equal outputs prove the peer's came
        matches(llm, trainer, 9, 3)
        assert {w["replica"] for w in llm.worker_locations()} == {0, 1, 2}
        scale(trainer, 0.9)  # the next push reaches the new replica too
        stats = WeightSender(trainer, llm).push(version=10)
        assert [r.state for r in stats.replicas] == ["committed"] * 3
        matches(llm, trainer, 10, 3)


def test_bad_rolling_settings_are_refused_naming_the_field(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        sender = WeightSender(hf_model(trainer_dir), llm)
        for kwargs, field in [
            ({"policy": "some"}, "policy"),
            ({"policy": "rolling", "max_unavailable": 0}, "max_unavailable"),
            ({"policy": "rolling", "wave": "drop"}, "wave"),
        ]:
            with pytest.raises(ValueError, match=field):
                sender.push(version=2, **kwargs)
        assert [s["version"] for s in llm.fleet_state()] == [0, 0]

"""The server's view of a fleet: one `AsyncEngine` (engine thread) per replica behind one
front with `AsyncEngine`'s surface, so every route serves a fleet as it serves one engine.

A call's requests are routed one by one (`tandem.fleet.policy`: a request's samples stay on
one replica) and each replica streams its requests' updates into the call's one queue; the RL
controls act on every replica. A single engine is a fleet of one.

Replicas the fleet quarantined take no requests; a request lost with its replica before any of
its tokens went out runs again on another, one that had streamed tokens ends with an error
naming the lost replica. A call that finds no replica allowed (a rolling push with
``max_staleness=0`` before its first wave) waits for one on a thread of its own. A replica
restarted or added gets an engine thread of its own before it takes requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tandem.config import EngineConfig
from tandem.engine.dtype_auto import DtypeChoice
from tandem.engine.lora_registry import LoadedAdapter
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineState
from tandem.engine.stats import EngineStats, combined
from tandem.engine.tokenizer import Tokenizer
from tandem.fleet.board import NoReplicaError, ReplicaState
from tandem.fleet.fleet import Fleet
from tandem.fleet.policy import Routed
from tandem.lora.request import LoRARequest
from tandem.server.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    QueueFull,
    RequestUpdate,
    Submission,
)

log = logging.getLogger(__name__)


def _failed(index: int, reason: str) -> RequestUpdate:
    return RequestUpdate(index, [], True, [], 0, error=reason)


# the state a fleet reports: its replicas' worst (a dead replica is a dead fleet until the
# fleet can quarantine and heal it)
_WORST_FIRST = (
    EngineState.DEAD,
    EngineState.TORN,
    EngineState.NO_WEIGHTS,
    EngineState.SLEEPING,
    EngineState.RUNNING,
)


class AsyncFleet:
    def __init__(self, fleet: Fleet, max_waiting: int = 256):
        self.fleet = fleet
        self.max_waiting = max_waiting
        self.replicas = [self._engine_thread(r, engine) for r, engine in enumerate(fleet.engines)]
        self._lead = self.replicas[0]
        self._where: dict[str, Routed] = {}  # request id -> where it runs, until over
        self._on_over: dict[str, Callable[[str], None]] = {}  # request id -> submit's on_over
        self._lock = threading.Lock()
        fleet.replica_listeners.append(self._replica_started)

    def _engine_thread(self, r: int, engine) -> AsyncEngine:
        replica = AsyncEngine(engine, self.max_waiting)
        if len(self.fleet.engines) > 1:
            replica.on_lost = lambda *lost: self._rerun(replica, *lost)
            replica.label = f"replica {r}"
        return replica

    def _replica_started(self, r: int, replica) -> None:
        """Replica ``r`` is new (restarted, or added): an engine thread for its engine."""
        fresh = self._engine_thread(r, replica.engine)
        with self._lock:
            old = self.replicas[r] if r < len(self.replicas) else None
            if old is None:
                self.replicas.append(fresh)
            else:
                self.replicas[r] = fresh
        if old is not None:
            threading.Thread(
                target=old.close, args=(f"replica {r} was restarted",), daemon=True
            ).start()

    # ----- what every replica shares: the lead's -----
    @property
    def config(self) -> EngineConfig:
        return self._lead.config

    @property
    def dtype_choice(self) -> DtypeChoice:
        return self._lead.dtype_choice

    @property
    def tokenizer(self) -> Tokenizer:
        return self._lead.tokenizer

    @property
    def model_config(self):
        return self._lead.model_config

    @property
    def model_class(self):
        return self._lead.model_class

    @property
    def max_model_len(self) -> int:
        return self._lead.max_model_len

    def text(self, seq: Sequence) -> str:
        return self._lead.text(seq)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self._lead.prompt_ids(prompt)

    def tokenize_inputs(self, items):
        return self._lead.tokenize_inputs(items)

    def prepare(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> list[Sequence]:
        """Check one prompt (every replica has the same limits) and make its samples; their
        ids are unique across the fleet (one admission numbers them all)."""
        return self._lead.prepare(request_id, prompt_ids, params, priority)

    # ----- LoRA adapters: the lead's (enable_lora needs data_parallel_size 1) -----
    def lora_adapters(self) -> list[LoadedAdapter]:
        return self.replicas[0].lora_adapters()

    def load_lora_adapter(self, name: str, path: str, int_id: int | None = None) -> LoadedAdapter:
        return self.replicas[0].load_lora_adapter(name, path, int_id)

    def unload_lora_adapter(self, name: str) -> None:
        self.replicas[0].unload_lora_adapter(name)

    def pin_lora(self, request: LoRARequest) -> tuple[LoadedAdapter, Callable[[], None]]:
        """The adapter version a request runs with (`AsyncEngine.pin_lora`; blocking) and the
        call that unpins it, on the engine that pinned it."""
        replica = self.replicas[0]
        adapter = replica.pin_lora(request)
        return adapter, lambda: replica.unpin_lora(adapter)

    # ----- the fleet as a whole -----
    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.replicas)

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.replicas)

    @property
    def weight_version(self) -> int:
        return self.fleet.weight_version

    @property
    def state(self) -> EngineState:
        states = {r.state for r in self.replicas}
        return next(s for s in _WORST_FIRST if s in states)

    @property
    def torn_reason(self) -> str | None:
        reasons = [
            f"replica {i}: {why}"
            for i, r in enumerate(self.replicas)
            if (why := r.torn_reason) is not None
        ]
        return "; ".join(reasons) or None

    @property
    def paused(self) -> str | None:
        return self._lead.paused

    @property
    def memory_released(self) -> dict[str, bool]:
        released = [r.memory_released for r in self.replicas]
        return {k: any(m[k] for m in released) for k in released[0]}

    def stats(self) -> EngineStats:
        return combined([r.stats() for r in self.replicas])

    def unavailable(self) -> str | None:
        """Why no request can be served now (a fleet: by any replica), or None."""
        if len(self.replicas) == 1:
            return self._lead.unavailable()
        self.fleet.check()
        reasons = []
        for i, r in enumerate(list(self.replicas)):
            why = r.unavailable()
            if self.fleet.board.state(i) is ReplicaState.QUARANTINED:
                why = f"quarantined: {self.fleet.board.reason(i)}"
            if why is None:
                return None
            reasons.append(f"replica {i}: {why}")
        return "; ".join(reasons)

    def replica_health(self) -> list[dict]:
        """Each replica: the fleet's report (`Fleet.report`: replica, state, version, load,
        requests, status, reason) and its engine's state (``engine``: running, sleeping...)."""
        replicas = list(self.replicas)
        return [
            {**entry, "engine": replicas[entry["replica"]].state.value}
            for entry in self.fleet.report()
        ]

    def fleet_state(self) -> list[dict]:
        return self.fleet.fleet_state()

    def exchange_server(self):
        """Where trainers push: one push updates every replica (blocking)."""
        return self.fleet.exchange_server()

    def on_weight_update(self, listener) -> None:
        self.fleet.update_listeners.append(listener)

    # ----- requests -----
    def submit(
        self,
        call_id: str,
        requests: list[tuple[str, list[Sequence]]],
        on_over: Callable[[str], None] | None = None,
        streams: bool = True,
    ) -> Submission:
        """Route each request of API call ``call_id`` to a replica and queue them all (or
        none); every update reaches the call's one queue. ``on_over(request_id)`` once each
        request is over (finished, aborted or failed; on an engine thread), if queued.
        ``streams``: the client sees tokens as they come (a request whose replica is lost
        runs again elsewhere only if none went out; answered in one piece, it always may).
        Raises
        QueueFull, EngineUnavailable (no replica can serve), ValueError (a live call has that
        id)."""
        if (why := self.unavailable()) is not None:
            raise EngineUnavailable(why)
        if self.num_waiting + len(requests) > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (max_waiting_requests)")
        if any(r.is_live(call_id) for r in self.replicas):
            raise ValueError(f"request id {call_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        indexed = list(enumerate(requests))
        if on_over is not None:
            with self._lock:
                self._on_over.update((rid, on_over) for rid, _ in requests)
        try:
            self._place(call_id, indexed, queue, asyncio.get_running_loop(), streams, wait_s=0)
        except NoReplicaError:  # none allowed yet, one will be (a rolling wave): wait apart
            threading.Thread(
                target=self._place_later,
                daemon=True,
                args=(call_id, indexed, queue, asyncio.get_running_loop(), streams),
                name="tandem-fleet-wait",
            ).start()
        except BaseException:  # none queued: none will be over
            with self._lock:
                for rid, _ in requests:
                    self._on_over.pop(rid, None)
            raise
        return Submission(self, [rid for rid, _ in requests], queue)

    def _place(
        self,
        call_id: str,
        indexed: list,
        queue: asyncio.Queue,
        loop,
        streams: bool,
        wait_s: float | None = None,
        lost: tuple[int, str] | None = None,
    ) -> None:
        """Route each (index, (request id, sequences)) of a call and queue it on its replica
        (all routed before any is queued; ``lost``: the replica that lost them and why,
        `Fleet.rerun`). NoReplicaError if none may take them within ``wait_s``."""
        by_replica: dict[int, list] = {}
        routed = []
        try:
            for i, (rid, seqs) in indexed:
                first = seqs[0]
                prompt = first.token_ids[: first.num_prompt_tokens]
                args = (prompt, len(seqs), first.params.max_tokens or 0)
                where = (
                    self.fleet.route(*args, wait_s=wait_s)
                    if lost is None
                    else self.fleet.rerun(*lost, *args, wait_s=wait_s)
                )
                routed.append((rid, where))
                by_replica.setdefault(where.replica, []).append((i, (rid, seqs)))
        except NoReplicaError:
            for _, where in routed:
                self.fleet.finished(where)
            raise
        with self._lock:
            self._where.update(routed)
            replicas = {r: self.replicas[r] for r in by_replica}
        for r, mine in sorted(by_replica.items()):
            replicas[r].enqueue(call_id, mine, queue, self._over, loop, streams)

    def _place_later(
        self, call_id: str, indexed: list, queue: asyncio.Queue, loop, streams: bool
    ) -> None:
        try:
            self._place(call_id, indexed, queue, loop, streams)
        except NoReplicaError as exc:
            for i, (rid, _) in indexed:
                self._over(rid)
                loop.call_soon_threadsafe(queue.put_nowait, _failed(i, str(exc)))

    def _rerun(
        self, lost: AsyncEngine, request_id: str, call_id: str | None, tracked, reason: str
    ) -> bool:
        """A request ``lost`` could not finish and nothing of it went out: run it again on
        another replica (fresh samples, which the call is told of first). Whether one took
        it."""
        if call_id is None:
            return False
        first = tracked.seqs[0]
        prompt = first.token_ids[: first.num_prompt_tokens]
        # a replica restarted meanwhile has a new engine thread: the lost one is not its own
        where = (self.replicas.index(lost), reason) if lost in self.replicas else None
        try:
            seqs = self._lead.prepare(request_id, prompt, first.params, first.priority)
            tracked.post(RequestUpdate(tracked.prompt_index, [], False, [], 0, restarted=seqs))
            self._place(
                call_id,
                [(tracked.prompt_index, (request_id, seqs))],
                tracked.queue,
                tracked.loop,
                tracked.streams,
                lost=where,
            )
        except Exception as exc:  # no replica left, or the call id went: it fails as lost
            log.warning(
                "request %s lost with its replica (%s) and not run again: %s",
                request_id,
                reason,
                exc,
            )
            return False
        return True

    def _over(self, request_id: str) -> None:
        with self._lock:
            where = self._where.pop(request_id, None)
            on_over = self._on_over.pop(request_id, None)
        if where is not None:
            self.fleet.finished(where)
        if on_over is not None:
            on_over(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            where = self._where.get(request_id)
        if where is not None:
            self.replicas[where.replica].abort(request_id)

    def abort_requests(self, call_ids: list[str] | None) -> list[str]:
        return sorted({c for r in self.replicas for c in r.abort_requests(call_ids)})

    async def encode(self, inputs, types, pooling):
        """Embed / classify on the replica with the fewest requests waiting."""
        replica = min(self.replicas, key=lambda r: (r.num_waiting, r.num_running))
        return await replica.encode(inputs, types, pooling)

    # ----- controls: every replica (blocking: call in a thread) -----
    def _each(self, call) -> list:
        if len(self.replicas) == 1:
            return [call(self._lead)]
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            futures = [pool.submit(call, r) for r in self.replicas]
        return [f.result() for f in futures]

    def reset_prefix_cache(self) -> None:
        self._each(lambda r: r.reset_prefix_cache())
        self.fleet.forget_prefixes()

    def sleep(self, level: int = 1) -> None:
        self._each(lambda r: r.sleep(level))
        self.fleet.forget_prefixes()

    def wake(self, kv_cache: bool = True, weights: bool = True) -> None:
        self._each(lambda r: r.wake(kv_cache, weights))

    def reload_weights(self) -> None:
        with self.fleet.holding_pushes():  # no replica seen behind the others meanwhile
            self._each(lambda r: r.reload_weights())
        self.fleet.forget_prefixes()

    def pause(self, mode: str, timeout: float | None = None) -> int:
        return sum(self._each(lambda r: r.pause(mode, timeout)))

    def resume(self) -> None:
        self._each(lambda r: r.resume())

    def close(self, reason: str = "the server is shutting down") -> None:
        self._each(lambda r: r.close(reason))

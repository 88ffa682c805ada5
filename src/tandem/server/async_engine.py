"""The engine on a thread of its own, for an asyncio server.

Requests are handed to the engine thread, which steps while any are unfinished and, after every
step, posts each request's new tokens (and text, logprobs, finish reasons) to the request's
asyncio queue. Weight pushes (the exchange server's thread) take the engine lock between steps,
so they land between decode steps and every sequence records the versions that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.config import EngineConfig
from tandem.engine.dtype_auto import DtypeChoice
from tandem.engine.engine import LLMEngine
from tandem.engine.executor import EngineDeadError
from tandem.engine.lora_registry import LoadedAdapter
from tandem.engine.outputs import CompletionOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineAsleepError, EngineState
from tandem.engine.stats import EngineStats
from tandem.engine.tokenizer import Tokenizer
from tandem.exchange.receiver import WeightSyncError
from tandem.lora.request import LoRARequest

log = logging.getLogger("tandem.serve")
HEALTH_CHECK_S = 1.0  # how often an idle engine checks its workers


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (dead, torn weights, shutting down)."""


class QueueFull(RuntimeError):
    """Too many requests are waiting; retry later."""


PROMPT_SEPARATOR = "#"  # never in an id a client chooses (`protocol.REQUEST_ID_PATTERN`)


def prompt_request_id(call_id: str, index: int) -> str:
    """The engine's id of prompt ``index`` of an API call: ``<call id>#<index>``. Clients name
    calls, never these, so a client's id cannot be mistaken for one tandem derived."""
    return f"{call_id}{PROMPT_SEPARATOR}{index}"


@dataclass(slots=True)
class RequestUpdate:
    prompt_index: int  # which request of the submission
    deltas: list[CompletionOutput]  # per sample: what it produced since the last update
    finished: bool  # every sample of the request is done
    weight_versions: list[int]  # versions that produced the request's tokens so far
    num_output_tokens: int
    error: str | None = None  # the engine failed; the request is over
    # the request's replica was lost and nothing of it had reached the client: it runs again
    # from its prompt on another replica, and these are its samples now
    restarted: list[Sequence] | None = None


class Submission:
    """The requests of one API call (one per prompt), their updates on one queue."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], queue: asyncio.Queue):
        self._engine = engine
        self._ids = request_ids
        self._queue = queue
        self._unfinished = set(range(len(request_ids)))

    async def updates(self) -> AsyncIterator[RequestUpdate]:
        """Every update of every request until all are finished; raises EngineUnavailable
        when the engine fails. Leaving early (client gone) must be followed by `abort`."""
        while self._unfinished:
            update = await self._queue.get()
            if update.error is not None:
                self._unfinished.clear()
                raise EngineUnavailable(update.error)
            if update.finished:
                self._unfinished.discard(update.prompt_index)
            yield update

    def abort(self) -> None:
        """Stop the requests still running (no-op once all finished)."""
        for i in self._unfinished:
            self._engine.abort(self._ids[i])
        self._unfinished.clear()


@dataclass
class _Tracked:
    prompt_index: int
    seqs: list[Sequence]
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    streams: bool = True  # its tokens reach the client as posted (else at the end, as one)
    sent_tokens: list[int] = field(default_factory=list)  # per sample, already posted
    sent_chars: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)  # its final update went out

    def __post_init__(self):
        self.sent_tokens = [0] * len(self.seqs)
        self.sent_chars = [0] * len(self.seqs)
        self.done = [False] * len(self.seqs)

    def post(self, update: RequestUpdate) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, update)


@dataclass
class _Encode:
    """One API call's inputs for `Encoder.encode`, answered on its event loop."""

    inputs: list[list[int]]
    types: list[list[int]] | None
    pooling: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def answer(self, rows: list[list[float]] | None, error: Exception | None = None) -> None:
        def settle():
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(rows)

        self.loop.call_soon_threadsafe(settle)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256):
        self._core = engine  # reached only through the methods below
        self.max_waiting = max_waiting
        self.generated_tokens = 0  # all requests, for metrics
        self._cond = threading.Condition()
        self._new: list[tuple[str, _Tracked]] = []
        self._aborts: list[str] = []
        self._tracked: dict[str, _Tracked] = {}
        self._live: dict[str, str] = {}  # request id -> its call's id, until over (`_cond`)
        self._on_over: dict[str, object] = {}  # request id -> called once it is over
        self._closed: str | None = None
        self._republish = False  # sequences finished outside a step (pause, abort): post them
        self._encodes: list[_Encode] = []  # embed / classify calls, batched together
        # a fleet's: (request id, call id, tracked, reason) -> whether another replica took
        # a request this engine lost (dead or torn) before any of its tokens went out
        self.on_lost = None
        self.label = "the engine"  # a fleet's replica: "replica i" (in errors)
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # ----- event-loop side -----
    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted (a request's n samples count once)."""
        waiting = {seq.request_id for seq in list(self._core.scheduler.waiting)}
        return len(waiting) + len(self._new)

    @property
    def num_running(self) -> int:
        return len(self._core.scheduler.running)

    @property
    def config(self) -> EngineConfig:
        return self._core.config

    @property
    def dtype_choice(self) -> DtypeChoice:
        return self._core.dtype_choice

    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer

    @property
    def model_config(self):
        """The model's parsed ``config.json`` (labels of a classifier: ``id2label``)."""
        return self._core.spec.config

    @property
    def model_class(self):
        return self._core.spec.cls

    @property
    def max_model_len(self) -> int:
        return self._core.limits.max_model_len

    @property
    def weight_version(self) -> int:
        return self._core.weight_version

    @property
    def state(self) -> EngineState:
        return self._core.state

    @property
    def torn_reason(self) -> str | None:
        lifecycle = self._core.controls.lifecycle
        return lifecycle.reason if lifecycle.state is EngineState.TORN else None

    def stats(self) -> EngineStats:
        return self._core.stats()

    def text(self, seq: Sequence) -> str:
        """A sample's output text so far (final once it finished)."""
        return self._core.outputs.text(seq)

    def exchange_server(self):
        """The engine's weight-exchange server (started on first use; blocking)."""
        return self._core.target.exchange_server()

    def on_weight_update(self, listener) -> None:
        """``listener(version, seconds, error or None)`` after every push attempt."""
        self._core.window.update_listeners.append(listener)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (blocking: call in a thread)."""
        self._core.reset_prefix_cache()

    # LoRA adapters (`tandem.engine.lora_adapters`; the server's side: `ServedAdapters`)
    def lora_adapters(self) -> list[LoadedAdapter]:
        """The latest version of every adapter in a slot (none without enable_lora)."""
        return self._core.adapters.loaded()

    def load_lora_adapter(self, name: str, path: str, int_id: int | None = None) -> LoadedAdapter:
        """Load adapter ``name`` (a new version if loaded) from PEFT directory ``path``
        (blocking: a push into the engine; call in a thread). Raises LoRAError."""
        return self._core.adapters.load(name, path, int_id=int_id)

    def unload_lora_adapter(self, name: str) -> None:
        self._core.adapters.unload(name)

    def pin_lora(self, request: LoRARequest) -> LoadedAdapter:
        """The latest version of the adapter, held in its slot until `unpin_lora` (loaded
        first from ``request.lora_path`` if the engine lacks it; blocking)."""
        return self._core.adapters.pin(request)

    def unpin_lora(self, adapter: LoadedAdapter) -> None:
        self._core.adapters.unpin(adapter)

    def unavailable(self) -> str | None:
        """Why no request can be served now, or None."""
        if self._closed is not None:
            return self._closed
        return self._core.unavailable()

    def prepare(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> list[Sequence]:
        """Check one prompt (ValueError names the problem) and make its samples."""
        return self._core.admission.make_sequences(request_id, prompt_ids, params, priority)

    def submit(self, call_id: str, requests: list[tuple[str, list[Sequence]]]) -> Submission:
        """Queue the prepared requests of API call ``call_id`` (all or none). Raises QueueFull,
        EngineUnavailable, ValueError (a live call has that id)."""
        if (why := self.unavailable()) is not None:
            raise EngineUnavailable(why)
        if self.num_waiting + len(requests) > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (max_waiting_requests)")
        queue: asyncio.Queue = asyncio.Queue()
        self.enqueue(call_id, list(enumerate(requests)), queue)
        return Submission(self, [rid for rid, _ in requests], queue)

    def enqueue(
        self,
        call_id: str,
        requests: list[tuple[int, tuple[str, list[Sequence]]]],
        queue: asyncio.Queue,
        on_over=None,
        loop=None,
        streams: bool = True,
    ) -> None:
        """Queue requests of API call ``call_id`` (each with its index in the call), posting
        their updates to ``queue`` (on ``loop``: the running one by default);
        ``on_over(request_id)`` once each is over (finished, aborted or failed); ``streams``:
        whether the client sees tokens as they are posted. ValueError if a live call has
        that id."""
        loop = loop or asyncio.get_running_loop()
        tracked = [(rid, _Tracked(i, seqs, queue, loop, streams)) for i, (rid, seqs) in requests]
        with self._cond:
            if call_id in self._live.values():
                raise ValueError(f"request id {call_id!r} is already in use")
            self._live.update((rid, call_id) for rid, _ in tracked)
            if on_over is not None:
                self._on_over.update((rid, on_over) for rid, _ in tracked)
            self._new.extend(tracked)
            self._cond.notify()

    def is_live(self, call_id: str) -> bool:
        """Whether a call with this id still has requests here."""
        with self._cond:
            return call_id in self._live.values()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 2: and the weights); requests queue up until `wake`
        (blocking: call in a thread)."""
        self._core.controls.sleep(level)

    def wake(self, kv_cache: bool = True, weights: bool = True) -> None:
        self._core.controls.wake(kv_cache, weights)
        self._poke()

    def reload_weights(self) -> None:
        """The checkpoint's weights again (blocking: call in a thread)."""
        self._core.controls.reload_weights()
        self._poke()

    @property
    def memory_released(self) -> dict[str, bool]:
        lifecycle = self._core.controls.lifecycle
        return {"kv_cache": lifecycle.kv_released, "weights": lifecycle.weights_released}

    @property
    def paused(self) -> str | None:
        return self._core.controls.paused

    def pause(self, mode: str, timeout: float | None = None) -> int:
        """Stop generating (`Controls.pause`); the callers of aborted requests get their
        partial outputs. ``wait`` returns once the running sequences finished (or after
        ``timeout`` seconds: TimeoutError, still paused). Returns the sequences aborted.
        Blocking: call in a thread."""
        aborted = self._core.controls.pause(mode)
        self._poke(publish=True)
        if mode == "wait" and not self._core.controls.wait_held(timeout):
            if self._core.state is EngineState.RUNNING:
                raise TimeoutError(f"running requests did not finish in {timeout} s")
        return len(aborted)

    def resume(self) -> None:
        self._core.controls.resume()
        self._poke()

    def abort_requests(self, call_ids: list[str] | None) -> list[str]:
        """End these API calls now (by the ``id`` of their response: every prompt of each;
        None: every call), returning what they generated to their callers with finish_reason
        ``abort``. Returns the ids of the calls aborted."""
        with self._cond:
            live = dict(self._live)
        if call_ids is not None:
            wanted = set(call_ids)
            live = {rid: call for rid, call in live.items() if call in wanted}
        aborted = self._core.controls.abort_requests(set(live))
        self._poke(publish=True)
        return sorted({live[seq.request_id] for seq in aborted})

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: `Admission.prompt_ids`."""
        return self._core.admission.prompt_ids(prompt)

    def tokenize_inputs(self, items) -> tuple[list[list[int]], list[list[int]] | None]:
        """Texts or token-id lists -> (ids, token types or None): `Admission.tokenize_inputs`."""
        return self._core.admission.tokenize_inputs(items)

    async def encode(
        self, inputs: list[list[int]], types: list[list[int]] | None, pooling: str | None
    ) -> list[list[float]]:
        """Pooled vectors or head logits of one call's inputs (ValueError names a bad input).
        Calls waiting together run as one unpadded batch on the engine thread."""
        pooling = self._core.admission.check_encode(inputs, pooling)
        if (why := self.unavailable()) is not None:
            raise EngineUnavailable(why)
        loop = asyncio.get_running_loop()
        call = _Encode(inputs, types, pooling, loop.create_future(), loop)
        with self._cond:
            self._encodes.append(call)
            self._cond.notify()
        return await call.future

    def _poke(self, publish: bool = False) -> None:
        with self._cond:
            self._republish = self._republish or publish
            self._cond.notify()

    def close(self, reason: str = "the server is shutting down") -> None:
        with self._cond:
            self._closed = reason
            self._cond.notify()
        self._thread.join(timeout=30)

    # ----- engine thread -----
    def _runnable(self) -> bool:
        core = self._core
        running = core.state is EngineState.RUNNING
        return core.has_unfinished() and running and not core.controls.held()

    def _lost(self) -> bool:
        """Requests are held by an engine that died or was torn while they could not step
        (paused, say): they must fail (or run again elsewhere) now, not at `resume`."""
        return bool(self._tracked) and self._core.state in (EngineState.TORN, EngineState.DEAD)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._closed
                    or self._new
                    or self._aborts
                    or self._republish
                    or self._encodes
                    or self._runnable()
                    or self._lost()
                ):
                    if not self._cond.wait(timeout=HEALTH_CHECK_S):
                        self._core.check_health()  # idle: is every worker still there?
                if self._closed:
                    break
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                republish, self._republish = self._republish, False
                encodes, self._encodes = self._encodes, []
            if encodes:
                self._run_encodes(encodes)
            for request_id, tracked in new:
                self._tracked[request_id] = tracked
                self._core.add(tracked.seqs)
            for request_id in aborts:
                tracked = self._tracked.pop(request_id, None)
                self._over([request_id])
                if tracked is not None:
                    self._core.abort(tracked.seqs)
            if republish:
                self._publish()
            if self._core.state in (EngineState.TORN, EngineState.DEAD, EngineState.NO_WEIGHTS):
                self._fail_all(self.unavailable())
                continue
            if not self._runnable():
                continue
            if (hold := self._core.batch_window_left()) > 0:
                with self._cond:  # a static batch fills up; an arrival wakes us at once
                    self._cond.wait(timeout=hold)
                continue
            try:
                self._core.step()
            except EngineAsleepError:
                continue  # put to sleep between the check and the step: requests wait
            except (EngineDeadError, WeightSyncError) as exc:
                self._fail_all(str(exc))
                continue
            except Exception as exc:  # a bug: fail what is running, never hang the clients
                log.exception("engine step failed")
                self._fail_all(f"internal error in the engine: {type(exc).__name__}: {exc}")
                continue
            self._publish()
        self._fail_all(self._closed)

    def _run_encodes(self, calls: list[_Encode]) -> None:
        """Every waiting encode call, one engine batch per pooling (the engine packs them
        unpadded within its token budget); each call gets its own rows back."""
        by_pooling: dict[str, list[_Encode]] = {}
        for call in calls:
            by_pooling.setdefault(call.pooling, []).append(call)
        for pooling, group in by_pooling.items():
            inputs = [ids for call in group for ids in call.inputs]
            types = None
            if any(call.types is not None for call in group):
                types = []
                for call in group:
                    types += call.types or [[0] * len(ids) for ids in call.inputs]
            try:
                rows = self._core.encoder.run(inputs, types, pooling)
            except (EngineDeadError, EngineAsleepError, RuntimeError) as exc:
                for call in group:
                    call.answer(None, EngineUnavailable(str(exc)))
                continue
            start = 0
            for call in group:
                call.answer(rows[start : start + len(call.inputs)])
                start += len(call.inputs)

    def _fail_all(self, reason: str) -> None:
        tracked, self._tracked = self._tracked, {}
        with self._cond:
            calls = {rid: self._live.get(rid) for rid in tracked}
        self._over(tracked)
        lost = self._core.state in (EngineState.DEAD, EngineState.TORN) and self.on_lost
        for rid, t in tracked.items():
            if self._core.state is not EngineState.DEAD:
                self._core.abort(t.seqs)
            went_out = t.streams and any(t.sent_tokens)  # an answer in one piece: nothing did
            if lost and not went_out and self.on_lost(rid, calls[rid], t, reason):
                continue  # nothing went out yet: it runs again on another replica
            why = f"{self.label} was lost: {reason}" if lost else reason
            t.post(RequestUpdate(t.prompt_index, [], True, [], 0, error=why))

    def _publish(self) -> None:
        done = []
        for request_id, t in self._tracked.items():
            deltas = [d for i, seq in enumerate(t.seqs) if (d := self._delta(t, i, seq))]
            if not deltas:
                continue
            finished = all(s.finished for s in t.seqs)
            versions = sorted(set().union(*(s.weight_versions for s in t.seqs)))
            outputs = sum(s.num_output_tokens for s in t.seqs)
            self.generated_tokens += sum(len(d.token_ids) for d in deltas)
            t.post(RequestUpdate(t.prompt_index, deltas, finished, versions, outputs))
            if finished:
                done.append(request_id)
        for request_id in done:
            del self._tracked[request_id]
        self._over(done)

    def _over(self, request_ids) -> None:
        with self._cond:
            calls = [
                (rid, self._on_over.pop(rid, None))
                for rid in request_ids
                if self._live.pop(rid, None) is not None
            ]
        for request_id, on_over in calls:
            if on_over is not None:
                on_over(request_id)

    def _delta(self, t: _Tracked, i: int, seq: Sequence) -> CompletionOutput | None:
        if t.done[i] or (seq.num_output_tokens == t.sent_tokens[i] and not seq.finished):
            return None
        text = self._core.outputs.stable_text(seq)  # what may still change is held back
        cut = len(text)
        start = t.sent_tokens[i]
        chars = t.sent_chars[i]
        delta = seq.output(text[chars:cut] if cut > chars else "", start)
        t.sent_chars[i] = max(chars, cut)
        t.sent_tokens[i] = seq.num_output_tokens
        t.done[i] = seq.finished
        return delta

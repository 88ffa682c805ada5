"""A vLLM engine as a `tandem.exchange.WeightTarget`: `WeightSender(model, vllm_llm)` pushes
into an offline ``LLM`` (`OfflineEngine`), ``vllm serve`` hands out its exchange through
tandem's middleware (`ServedEngine`, `tandem.integrations.vllm.serve`), and any trainer
process given the `exchange_address` pushes the same way.

The engine must have been made with tandem's worker extension (``LLM(...,
worker_extension_cls=WORKER_EXTENSION)``, ``--worker-extension-cls``): each vLLM worker is one
receiving rank, its boxes declared by the table of its model class
(`tandem.integrations.vllm.layouts`). The phases of a push run on every worker through vLLM's
``collective_rpc``, which vLLM's engine core runs between two steps, so no step sees a phase
half done. A push is always staged (vLLM's CPU
build keeps only repacked linear weights: see `tandem.integrations.vllm.receiver`): a push
rejected before its commit leaves the old weights serving; a commit that fails part-way leaves
vLLM with mixed weights, which vLLM cannot be told to refuse requests for, so the target says
so (`unavailable`, `weight_state`, the error of that push and of every push until one lands).
After a push lands, vLLM's prefix cache is reset. A rolling push (a fleet of vLLM servers
behind `tandem router`) holds each worker's verified copy while the old weights serve
(`PushPhase.HOLD`), and its wave commits it under vLLM's own pause (``wait`` or ``keep``, the
push's ``wave``), resumed after.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.exchange.target import UpdateListener
from tandem.integrations.vllm.messages import (
    VLLM,
    PhaseReply,
    PhaseRequest,
    SendWeights,
    WeightsSent,
    WorkerInfo,
)


class OfflineEngine:
    """A vLLM ``LLM`` in this process, held weakly (the target does not keep it alive)."""

    def __init__(self, llm):
        self._llm = weakref.ref(llm)

    @property
    def llm(self):
        llm = self._llm()
        if llm is None:
            raise WeightSyncError("the vLLM engine is gone")
        return llm

    def rpc(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def pause(self, mode: str) -> None:
        pass  # an offline engine runs no request while a phase runs (the caller's thread)

    def resume(self) -> None:
        pass

    def on_collected(self, callback) -> None:
        weakref.finalize(self.llm, callback)


class ServedEngine:
    """The engine client of a ``vllm serve`` (vLLM's ``AsyncLLM``), driven from the exchange's
    threads through the server's event loop."""

    def __init__(self, client, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.loop = loop

    def rpc(self, method: str, *args) -> list:
        return self._run(self.client.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> None:
        self._run(self.client.reset_prefix_cache())

    def pause(self, mode: str) -> None:
        """vLLM's own pause (what ``POST /pause?mode=...`` does): ``wait`` lets the requests
        running finish, ``keep`` freezes them where they are; new ones wait."""
        self._run(self.client.pause_generation(mode=mode))

    def resume(self) -> None:
        self._run(self.client.resume_generation())

    def on_collected(self, callback) -> None:
        pass  # the server's engine lives as long as the server

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class VllmTarget:
    """``engine``: a vLLM engine made with tandem's worker extension (`OfflineEngine`,
    `ServedEngine`). Opens an exchange server (``host``: where it listens) whose address
    trainers push to; it closes when `close` is called or an offline engine is collected."""

    def __init__(self, engine: OfflineEngine | ServedEngine, host: str = "127.0.0.1"):
        from tandem.exchange.server import ExchangeServer

        self.engine = engine
        try:
            infos = [_decode(b, WorkerInfo) for b in engine.rpc("tandem_worker_info")]
        except Exception as exc:  # vLLM wraps a worker's AttributeError in its own error
            if "tandem_worker_info" not in str(exc):
                raise
            raise ValueError(
                "the vLLM engine has no tandem worker extension: make it with "
                "LLM(..., worker_extension_cls=tandem.integrations.vllm.WORKER_EXTENSION) "
                f"({exc})"
            ) from None
        self.workers = infos
        self._lock = threading.Lock()  # one push at a time
        self._version = 0
        self._torn: str | None = None
        # the version of every commit begun, in order, and how many had ended: which weights
        # a request may have met (`served`)
        self._commits: list[int] = []
        self._ended = 0
        self._served = threading.Lock()
        self.update_listeners: list[UpdateListener] = []
        self._server = ExchangeServer(self, host=host)
        engine.on_collected(self._server.close)

    @property
    def exchange_address(self) -> str:
        return self._server.address

    @property
    def exchange_server(self):
        return self._server

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_base(self) -> str | None:
        """None: vLLM's workers do not track the push their weights came from: pushes are dense."""
        return None

    @property
    def weight_dtype(self) -> str:
        return self.workers[0].layout.dtype

    @property
    def weight_device_type(self) -> str:
        return "cpu"

    @property
    def receivers_in_process(self) -> bool:
        return any(w.pid == os.getpid() for w in self.workers)

    def weight_layouts(self) -> list[RankLayout]:
        return [w.layout for w in self.workers]

    def unavailable(self) -> str | None:
        return self._torn

    def commit_begins(self, version: int) -> None:
        """From here a request may meet the weights of ``version``."""
        with self._served:
            self._commits.append(version)

    def commit_ended(self, landed: int | None) -> None:
        """The commit begun last ended: ``landed`` serves now (None: it did not land)."""
        with self._served:
            if landed is not None:
                self._version = landed
            self._ended = len(self._commits)

    def served_from(self) -> tuple[int, int]:
        """A request's start, to tell later which weights it met (`served_since`)."""
        with self._served:
            return self._version, self._ended

    def served_since(self, start: tuple[int, int]) -> list[int]:
        """The versions whose weights a request begun at ``start`` (`served_from`) may have
        run on: the one serving then, and that of every commit in flight then or begun
        since (vLLM reports no version per token: a commit that crossed the request is named,
        not ruled out)."""
        version, ended = start
        with self._served:
            return sorted({version, *self._commits[ended:]})

    def weight_state(self) -> dict:
        """``{"version": v, "torn": reason or None}``: what the engine serves."""
        return {"version": self._version, "torn": self._torn}

    def close(self) -> None:
        self._server.close()

    def refuses(self, settings: PushSettings) -> str | None:
        if settings.adapter is not None:
            return "tandem pushes no LoRA adapters into vLLM (vLLM loads them from directories)"
        if settings.in_place:
            return (
                "mode='in_place' cannot reach vLLM: its CPU build keeps linear weights only "
                "repacked for its kernels, so every push into vLLM is staged, then written "
                "into its layers and repacked by vLLM (use mode='staged')"
            )
        return None

    def send_to(self, url: str, transport: str, admin_key: str, timeout_s: float) -> dict:
        """Push the weights this engine serves, at its version, into the server at ``url``
        (another replica of a fleet healing or joining; started with ``admin_key``): each
        worker reads its weights back from vLLM's layers and pushes them as one trainer rank
        (`TandemWorkerExtension.tandem_send_weights`), the engine serving nothing meanwhile
        (vLLM runs the call between two steps); ``{version, bytes_moved, seconds}``. No push
        lands here meanwhile. Raises `WeightSyncError` naming each worker that failed."""
        with self._lock:
            if self._torn is not None:
                raise WeightSyncError(f"this engine holds mixed weights: {self._torn}")
            request = SendWeights(
                url, transport, self._version, admin_key, timeout_s, len(self.workers)
            )
            answers = self.engine.rpc("tandem_send_weights", VLLM.encode(request))
        replies = [_decode(b, WeightsSent) for b in answers]
        errors = [f"worker {i}: {r.error}" for i, r in enumerate(replies) if r.error]
        if errors:
            raise WeightSyncError(f"the push into {url} failed: {'; '.join(errors)}")
        return {
            "version": replies[0].version,
            "bytes_moved": sum(r.bytes_moved for r in replies),
            "seconds": round(max(r.seconds for r in replies), 4),
        }

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[VllmUpdate]:
        with self._lock:
            update = VllmUpdate(self, spec)
            try:
                yield update
            except BaseException:
                if not update.landed:
                    try:
                        update.call(PushPhase.ABORT, {})
                    except Exception:  # a worker is gone: vLLM reports that itself
                        pass
                raise
            finally:
                if update.torn is not None:
                    self._torn = update.torn
                elif update.landed:
                    self._torn = None
                    self.engine.reset_prefix_cache()  # cached KV came from the old weights


class VllmUpdate:
    """One push's phases on every vLLM worker (`tandem.exchange.UpdateWindow`)."""

    def __init__(self, target: VllmTarget, spec: UpdateSpec):
        self.target = target
        self.spec = spec
        self.landed = False
        self.torn: str | None = None
        self._opened = time.perf_counter()
        self._arrived = (0, 0.0)

    def expose(self) -> None:
        raise WeightSyncError("pushes into vLLM are staged: nothing is written in place")

    def ingress(self) -> dict[int, tuple[int, float]]:
        return {0: self._arrived}

    def failures(self) -> dict[int, str]:
        return {}  # a failure raises

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        if phase is not PushPhase.COMMIT:
            return self._run(phase, records_by_rank)
        rolling = self.spec.settings.rolling
        if rolling:
            # a rolling wave's commit, under vLLM's own pause: "wait" lets the requests running
            # finish first (those sent past the router too), "keep" freezes them across it
            self.target.engine.pause(self.spec.settings.wave)
        self.target.commit_begins(self.spec.version)
        try:
            return self._run(phase, records_by_rank)
        finally:
            self.target.commit_ended(self.spec.version if self.landed else None)
            if rolling:
                self.target.engine.resume()

    def _run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        replies = self.call(phase, records_by_rank)
        errors = [f"worker {i}: {r.error}" for i, r in enumerate(replies) if r.error]
        if errors:
            detail = "; ".join(errors)
            version = self.spec.version
            if any(r.torn for r in replies):
                self.torn = f"the commit of version {version} failed part-way: {detail}"
                raise WeightSyncError(
                    f"update to version {version} failed in {phase.value} after vLLM began "
                    f"loading it: vLLM now holds mixed weights and keeps serving them (it "
                    f"cannot be told to refuse requests); push again: {detail}"
                )
            serving = self.target.unavailable() or f"version {self.target.weight_version}"
            raise WeightSyncError(
                f"update to version {version} rejected in {phase.value}; "
                f"{serving} keeps serving: {detail}"
            )
        if phase is PushPhase.COMMIT:
            self.landed = True
        nbytes = sum(r.nbytes for r in replies)
        if phase in (PushPhase.RECEIVE, PushPhase.COMMIT) and not self._arrived[0]:
            self._arrived = (nbytes, 0.0)
        self._arrived = (self._arrived[0], time.perf_counter() - self._opened)
        return nbytes

    def call(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> list:
        ranks = len(self.target.workers)
        records = [records_by_rank.get(rank, []) for rank in range(ranks)]
        request = VLLM.encode(PhaseRequest(phase, self.spec, records))
        answers = self.target.engine.rpc("tandem_push_phase", request)
        return [_decode(b, PhaseReply) for b in answers]


def _decode(data: bytes, cls: type):
    msg = VLLM.decode(data)
    if not isinstance(msg, cls):
        raise ValueError(f"a vLLM worker answered {type(msg).__name__}, not {cls.__name__}")
    return msg

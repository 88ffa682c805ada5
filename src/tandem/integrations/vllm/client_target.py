"""A vLLM engine reached through vLLM's weight-sync client (`VLLMWeightSyncClient`: its HTTP
client, its Ray client, or an offline ``vllm.LLM`` through `OfflineClient`), made with the
``tandem`` weight-transfer backend, as a `tandem.exchange.WeightTarget`. It lives in the
trainer's rank 0 (`tandem.integrations.vllm.trainer`) with an exchange server every trainer
rank pushes to; each phase of a push is one call of vLLM's protocol
(`tandem.integrations.vllm.backend` says which).

vLLM's protocol answers only errors: the workers report their layouts, version and torn state
on a side connection when the client initializes them, the bytes of a phase are the ones the
plan sent, and a failed phase is known by the client's error (an HTTP 500 whose body says it).
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.errors import StaleVersionError
from tandem.exchange.address import ExchangeAddress
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.exchange.target import UpdateListener
from tandem.integrations.vllm.messages import (
    STALE_VERSION,
    TORN_COMMIT,
    VLLM,
    BackendHello,
    PhaseRequest,
    VersionCheck,
)
from tandem.wire import MAX_FRAME, accept_hello

log = logging.getLogger(__name__)

# how vLLM's worker refuses to finish an update it does not hold
NO_UPDATE = "finish_weight_update called without a matching start_weight_update"
REPORTS_AFTER_INIT_S = 10.0  # reports still to be taken once vLLM answered the init
# what a worker that refused a stale version serves (`TandemWeightTransferEngine`)
STALE_SERVES = re.compile(re.escape(STALE_VERSION) + r" \d+: this worker serves version (\d+)")


class OfflineClient:
    """An offline ``vllm.LLM`` as a `VLLMWeightSyncClient`: its methods take the payload
    wrapped (``{"init_info": ...}``, ``{"update_info": ...}``), the protocol's bare. Held
    weakly: a trainer does not keep vLLM's engine alive."""

    def __init__(self, llm):
        self._llm = weakref.ref(llm)

    @property
    def llm(self):
        llm = self._llm()
        if llm is None:
            raise WeightSyncError("the vLLM engine is gone")
        return llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict | list[dict]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def reset_prefix_cache(client) -> None:
    """Drop vLLM's cached KV, computed with the old weights, through the client: `OfflineClient`;
    the HTTP client's server, by its dev-mode route (which the weight-update routes need too);
    the Ray client's engine actors, each one (vLLM's ``LLM`` and ``AsyncLLM`` both have it)."""
    reset = getattr(client, "reset_prefix_cache", None)
    if reset is not None:
        reset()
        return
    handles = getattr(client, "handles", None)
    if handles is not None:
        import ray

        ray.get([handle.reset_prefix_cache.remote() for handle in handles])
        return
    base_url = getattr(client, "base_url", None)
    if base_url is not None:
        import requests

        requests.post(f"{base_url}/reset_prefix_cache", timeout=client.timeout).raise_for_status()


def client_error(exc: BaseException) -> str:
    """What vLLM said: an HTTP error's body (its message names the worker's error), else the
    exception's text."""
    response = getattr(exc, "response", None)
    if response is not None:
        try:
            return response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return response.text[:4000]
    return f"{type(exc).__name__}: {exc}"


class ClientTarget:
    """The vLLM engine behind ``client`` (its workers made with the ``tandem`` backend).
    Asks the workers to report at ``host`` (where they reach this process) and opens an
    exchange server there, whose address every trainer rank pushes to."""

    def __init__(self, client, host: str = "127.0.0.1", timeout_s: float = 300.0):
        from tandem.exchange.server import ExchangeServer

        self.client = client
        self.timeout_s = timeout_s
        self.update_listeners: list[UpdateListener] = []
        self._lock = threading.Lock()  # one push at a time
        hellos = self._init_workers(host)
        self.workers = [h.info for h in hellos]
        self._finish_left_open(hellos)
        self._version = max(h.version for h in hellos)
        torn = [f"worker {h.rank}: {h.torn}" for h in hellos if h.torn]
        if len({h.version for h in hellos}) > 1:
            torn.append(f"the workers serve versions {[h.version for h in hellos]}")
        self._torn = "; ".join(torn) or None
        self._server = ExchangeServer(self, host=host)

    def _init_workers(self, host: str) -> list[BackendHello]:
        """``client.init_weight_transfer_engine`` (on a thread: it returns once every worker
        reported) while the workers' reports are taken here."""
        listener = socket.create_server((host, 0))
        token = secrets.token_hex(16)
        address = ExchangeAddress(*listener.getsockname()[:2], token)
        failed: list[BaseException] = []

        def init() -> None:
            try:
                self.client.init_weight_transfer_engine({"trainer": str(address)})
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=init, name="tandem-vllm-init", daemon=True)
        thread.start()
        listener.settimeout(0.5)
        deadline = time.monotonic() + self.timeout_s
        hellos: dict[int, BackendHello] = {}
        try:
            while not hellos or len(hellos) < next(iter(hellos.values())).workers:
                if failed:
                    raise WeightSyncError(_init_failed(client_error(failed[0])))
                if not thread.is_alive():  # every worker sent its report before answering
                    deadline = min(deadline, time.monotonic() + REPORTS_AFTER_INIT_S)
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"vLLM's workers {sorted(hellos)} reported; not the others"
                    )
                # a report holds the worker's whole layout: as large as any frame
                peer = accept_hello(listener, token, VLLM, BackendHello, self.timeout_s, MAX_FRAME)
                if peer is not None:
                    peer[0].close()
                    hellos[peer[1].rank] = peer[1]
        finally:
            listener.close()
        thread.join(self.timeout_s)
        if failed or thread.is_alive():
            why = client_error(failed[0]) if failed else "it did not return"
            raise WeightSyncError(_init_failed(why))
        workers = next(iter(hellos.values())).workers
        if sorted(hellos) != list(range(workers)):
            raise WeightSyncError(f"vLLM's workers reported as {sorted(hellos)} of {workers}")
        return [hellos[rank] for rank in range(workers)]

    @property
    def exchange_address(self) -> str:
        return self._server.address

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
        import os

        return any(w.pid == os.getpid() for w in self.workers)

    def weight_layouts(self) -> list[RankLayout]:
        return [w.layout for w in self.workers]

    def unavailable(self) -> str | None:
        return self._torn

    def weight_state(self) -> dict:
        """``{"version": v, "torn": reason or None}``: what vLLM serves, as this trainer knows."""
        return {"version": self._version, "torn": self._torn}

    def close(self) -> None:
        self._server.close()

    def refuses(self, settings: PushSettings) -> str | None:
        if settings.adapter is not None:
            return "tandem pushes no LoRA adapters into vLLM (vLLM loads them from directories)"
        if settings.in_place:
            return (
                "mode='in_place' cannot reach vLLM: its CPU build keeps linear weights only "
                "repacked for its kernels, so every push into vLLM is staged (use "
                "mode='staged')"
            )
        if settings.rolling:
            return "policy='rolling' needs a fleet of tandem replicas (use policy='all')"
        return None

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[ClientWindow]:
        """vLLM's ``start_weight_update`` .. ``finish_weight_update(version)`` around one
        push, which every worker first checks goes forward (`ClientWindow.check_version`)."""
        with self._lock:
            try:
                self.client.start_weight_update()
            except Exception as exc:
                said = client_error(exc)
                if "tandem:" in said:  # tandem's last worker refused: the others started
                    self.end_failed_update()
                raise WeightSyncError(f"vLLM's start_weight_update failed: {said}") from None
            window = ClientWindow(self, spec)
            try:
                window.check_version()
                yield window
            except BaseException as exc:
                if isinstance(exc, StaleVersionError):  # another trainer pushed since
                    self._version = exc.served
                if window.failed:
                    self.end_failed_update()
                else:  # the trainers' side failed: the workers drop what the push staged
                    self.client.finish_weight_update()
                raise
            finally:
                if window.torn is not None:
                    self._torn = window.torn
            self.client.finish_weight_update(str(spec.version))
            self._torn, self._version = None, spec.version
            reset_prefix_cache(self.client)  # cached KV came from the old weights

    def end_failed_update(self, last_open: bool = False) -> None:
        """Finish the update vLLM's workers hold open after a call failed: its last worker
        raised the failure (`TandemWeightTransferEngine._answer`), which ended the update
        there (unless ``last_open``), and refuses the finish; the others finish it."""
        if len(self.workers) == 1 and not last_open:
            return
        try:
            self.client.finish_weight_update()
        except Exception as exc:
            if last_open or NO_UPDATE not in client_error(exc):
                raise

    def _finish_left_open(self, hellos: list[BackendHello]) -> None:
        """An update a trainer left open (it died mid-push): finish it (the workers dropped
        its push when they reported)."""
        if any(h.in_update for h in hellos):
            log.warning(
                "tandem: vLLM held an update open (its trainer left mid-push): "
                "finishing it; the weights it served still serve"
            )
            self.end_failed_update(last_open=hellos[-1].in_update)


def _init_failed(said: str) -> str:
    if "tandem:" in said:  # tandem's workers refused
        return f"vLLM's init_weight_transfer_engine failed: {said}"
    return (
        "vLLM's init_weight_transfer_engine failed (is it made with "
        f'--weight-transfer-config \'{{"backend": "tandem"}}\'?): {said}'
    )


class ClientWindow:
    """One push's phases, each one ``update_weights`` call carrying every worker's records
    (`tandem.exchange.UpdateWindow`)."""

    def __init__(self, target: ClientTarget, spec: UpdateSpec):
        self.target = target
        self.spec = spec
        self.failed = False  # a call failed: vLLM's last worker ended the update
        self.torn: str | None = None
        self._opened = time.perf_counter()
        self._arrived = (0, 0.0)

    def expose(self) -> None:
        raise WeightSyncError("pushes into vLLM are staged: nothing is written in place")

    def ingress(self) -> dict[int, tuple[int, float]]:
        return {0: self._arrived}

    def failures(self) -> dict[int, str]:
        return {}  # a failure raises

    def check_version(self) -> None:
        """Every worker refuses the push's version unless it is above the one the worker
        serves, or the push is a rollback (one ``update_weights`` call, before any byte
        moves): then `StaleVersionError` naming the version the workers serve."""
        from tandem.integrations.vllm.backend import encode_update

        check = encode_update(VersionCheck(self.spec.version, self.spec.rollback))
        try:
            self.target.client.update_weights([check] * len(self.target.workers))
        except Exception as exc:
            self.failed = True
            said = client_error(exc)
            served = [int(v) for v in STALE_SERVES.findall(said)]
            if served:
                raise StaleVersionError(self.spec.version, max(served)) from None
            raise WeightSyncError(
                f"vLLM's workers refused version {self.spec.version}: {said}"
            ) from None

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        from tandem.integrations.vllm.backend import encode_update

        records = [records_by_rank.get(rank, []) for rank in range(len(self.target.workers))]
        payload = [encode_update(PhaseRequest(phase, self.spec, [mine])) for mine in records]
        try:
            self.target.client.update_weights(payload)
        except Exception as exc:
            self.failed = True
            said = client_error(exc)
            if phase is PushPhase.COMMIT and TORN_COMMIT in said:
                self.torn = said
                raise WeightSyncError(said) from None
            raise WeightSyncError(
                said
                if "rejected in" in said
                else f"update to version {self.spec.version} failed in {phase.value}: {said}"
            ) from None
        nbytes = sum(r.nbytes for mine in records for r in mine)
        if phase in (PushPhase.RECEIVE, PushPhase.COMMIT) and not self._arrived[0]:
            self._arrived = (nbytes, 0.0)
        self._arrived = (self._arrived[0], time.perf_counter() - self._opened)
        return nbytes

"""A server as a replica of a fleet (`tandem router`'s): a `tandem serve` (`RemoteReplica`,
its health checked over ``GET /health``) or a ``vllm serve`` made with tandem's worker
extension and middleware (`VllmReplica`, `tandem.integrations.vllm.serve`); `probe` tells
which answers at a URL. Either's weights are a `WeightTarget` (`RemoteTarget`): its ranks'
layouts and a push window held open on it, over the same admin routes
(`/admin/weights/target`, `/admin/weights/refuses`, `/admin/weights/window...`, messages in
`tandem.fleet.window_messages`). The fleet makes a `FleetTarget` of these, so one push through
the router plans trainer ranks -> every replica's ranks at once, sends each byte once and
relays it, and commits on every replica or none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.fleet.replica import Health, Replica
from tandem.fleet.window_messages import (
    MEDIA_TYPE,
    WINDOW,
    CloseWindow,
    Expose,
    OpenWindow,
    Refusal,
    Refuses,
    RunPhase,
    TargetInfo,
    WindowReply,
)

TEXT_BLOCK = 64  # characters per prefix block: a router routes text, not token ids


class RemoteReplica:
    """The `tandem serve` at ``url`` (started with the router's admin key). Its health is its
    last ``GET /health`` answer (`refresh`; a check sent before the one recorded last is
    dropped: its answer may predate a push that the later one saw)."""

    kind = "tandem serve"
    in_process = False
    block = TEXT_BLOCK

    def __init__(
        self,
        url: str,
        admin_key: str | None,
        timeout_s: float,
        check_timeout_s: float = 2.0,
        cache_blocks: int = 4096,
    ):
        self.url = url.rstrip("/")
        self.name = self.url
        self.admin_key = admin_key
        self.timeout_s = timeout_s
        self.check_timeout_s = check_timeout_s
        self.cache_blocks = cache_blocks
        self.target = RemoteTarget(self.url, admin_key or "", timeout_s)
        self._lock = threading.Lock()
        self._health = Health(ok=False, version=0, reason="not checked yet")
        self._asked_at = 0.0  # when the check recorded last was sent (time.monotonic)

    @property
    def version(self) -> int:
        return self._health.version

    def health(self) -> Health:
        return self._health

    def refresh(self) -> None:
        asked = time.monotonic()
        try:
            r = httpx.get(f"{self.url}/health", timeout=self.check_timeout_s)
        except httpx.HTTPError as exc:
            self.record(asked, None, {}, f"no answer from {self.url}/health ({type(exc).__name__})")
            return
        self.record(asked, r.status_code, _json(r), None)

    def record(self, asked: float, status: int | None, body: dict, unreachable: str | None) -> None:
        """One health check's outcome, sent at ``asked``: ok when it answered 200 with
        ``status: ok`` as one replica (a server with replicas of its own would route each
        request again: the router's is the one decision)."""
        ok = unreachable is None and status == 200 and body.get("status") == "ok"
        reason = None if ok else (unreachable or body.get("reason") or f"/health answered {status}")
        if ok and len(replicas := body.get("replicas") or [None]) > 1:
            ok, reason = (
                False,
                (
                    f"it serves a fleet of its own ({len(replicas)} replicas, "
                    "--data-parallel-size): a router routes over servers of one "
                    "replica each"
                ),
            )
        with self._lock:
            if asked < self._asked_at:
                return
            self._asked_at = asked
            version = body.get("weight_version")
            self._health = Health(
                ok=ok,
                version=version if isinstance(version, int) else 0,
                fault=body.get("fault"),
                reason=reason,
            )

    def lost(self, reason: str) -> bool:
        """It could not be reached by a request: no more until a check finds it up."""
        with self._lock:
            self._health = Health(ok=False, version=self._health.version, reason=reason)
        return False

    def busy(self) -> None:
        return None  # what it runs is what the router sent it: the fleet's ledger knows

    def receive_address(self) -> str:
        return self.url

    def send_to(self, other: Replica, timeout_s: float) -> int:
        """``POST {url}/admin/weights/push_to``: this server's ranks in the trainer's role."""
        target = other.receive_address()
        same_host = urlsplit(self.url).hostname == urlsplit(target).hostname
        # the call wraps a whole push on the peer, under the peer's own deadlines: past them
        with httpx.Client(timeout=max(timeout_s, self.timeout_s)) as client:
            r = client.post(
                f"{self.url}/admin/weights/push_to",
                json={"url": target, "transport": "shm" if same_host else "dist"},
                headers={"authorization": f"Bearer {self.admin_key}"},
            )
        if r.status_code != 200:
            raise WeightSyncError(
                f"{self.url} could not push into {target}: {r.status_code} {r.text[:500]}"
            )
        return r.json()["version"]

    def paused(self) -> str | None:
        return None  # the router fans its controls out to every replica itself

    def pause(self, mode: str) -> None:
        raise NotImplementedError("a router pauses its replicas through their routes")

    def restarted(self) -> None:
        return None  # started by someone else: it heals once it answers again

    def report(self) -> dict:
        return {"url": self.url}

    def close(self) -> None:
        self.target.close()


class VllmReplica(RemoteReplica):
    """The ``vllm serve`` at ``url``, made with tandem's worker extension and middleware and
    started with the router's admin key as ``$TANDEM_ADMIN_KEY``. Requests go to it as to any
    OpenAI server. Its health: vLLM's ``GET /health`` (its engine alive), then what its
    weights say (``GET /admin/weights``: the version served, and mixed weights left by a
    commit that failed part-way, which vLLM keeps serving: a fault, quarantined and healed).
    It sends its weights to a peer as a `tandem serve` does (``POST
    /admin/weights/push_to``: its workers read them back from vLLM's layers and push them
    as trainer ranks), so a quarantined vLLM replica, answering again (restarted on its
    checkpoint, or torn), heals from a live one."""

    kind = "vllm serve"

    def refresh(self) -> None:
        asked = time.monotonic()
        try:
            alive = httpx.get(f"{self.url}/health", timeout=self.check_timeout_s)
            if alive.status_code != 200:
                self.record(asked, alive.status_code, {"reason": "vLLM's engine is down"}, None)
                return
            weights = httpx.get(
                f"{self.url}/admin/weights",
                timeout=self.check_timeout_s,
                headers={"authorization": f"Bearer {self.admin_key}"},
            )
        except httpx.HTTPError as exc:
            self.record(asked, None, {}, f"no answer from {self.url} ({type(exc).__name__})")
            return
        body = _json(weights)
        if weights.status_code != 200:
            reason = f"/admin/weights answered {weights.status_code}: {weights.text[:200]}"
            self.record(asked, weights.status_code, {"reason": reason}, None)
            return
        torn = body.get("torn")
        self.record(
            asked,
            200,
            {
                "status": "ok" if torn is None else "unavailable",
                "reason": None if torn is None else f"vLLM holds mixed weights: {torn}",
                "fault": None if torn is None else f"vLLM holds mixed weights: {torn}",
                "weight_version": body.get("version"),
            },
            None,
        )

    def report(self) -> dict:
        return {"url": self.url, "engine": "vllm"}


def server_replica(
    url: str, admin_key: str | None, timeout_s: float, check_timeout_s: float = 2.0
) -> RemoteReplica:
    """The server at ``url`` as a replica of its kind (`probe`)."""
    return probe(url, check_timeout_s)(url, admin_key, timeout_s, check_timeout_s)


def probe(url: str, timeout_s: float = 2.0) -> type[RemoteReplica]:
    """Which kind of server answers at ``url``: a `tandem serve` (its ``/health`` says
    ``status``) or a ``vllm serve`` (``/version`` names vLLM's); a server that does not
    answer is taken for a `tandem serve` (the router's default)."""
    url = url.rstrip("/")
    try:
        if "status" in _json(httpx.get(f"{url}/health", timeout=timeout_s)):
            return RemoteReplica
        if "version" in _json(httpx.get(f"{url}/version", timeout=timeout_s)):
            return VllmReplica
    except httpx.HTTPError:
        pass
    return RemoteReplica


def _json(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class RemoteTarget:
    """The weights of one `tandem serve` (started with the router's admin key)."""

    receivers_in_process = False

    def __init__(self, url: str, admin_key: str, timeout_s: float = 600.0):
        self.url = url
        self.update_listeners: list = []
        self._client = httpx.Client(
            base_url=url, timeout=timeout_s, headers={"authorization": f"Bearer {admin_key}"}
        )
        self._info: TargetInfo | None = None

    def info(self, fresh: bool = True) -> TargetInfo:
        if fresh or self._info is None:
            self._info = self._call("GET", "/admin/weights/target", None, TargetInfo)
        return self._info

    @property
    def weight_version(self) -> int:
        return self.info().version

    @property
    def weight_base(self) -> str | None:
        return self.info().base

    @property
    def weight_dtype(self) -> str:
        return self.info(fresh=False).dtype

    @property
    def weight_device_type(self) -> str:
        return self.info(fresh=False).device_type

    def refuses(self, settings: PushSettings) -> str | None:
        if self.info(fresh=False).replicas > 1:
            return (
                f"{self.url} serves a fleet of its own (--data-parallel-size > 1): push "
                "to it directly, or route over single-replica servers"
            )
        return self._call("POST", "/admin/weights/refuses", Refuses(settings), Refusal).reason

    def weight_layouts(self) -> list[RankLayout]:
        return self.info().layouts

    def unavailable(self) -> str | None:
        try:
            return self.info().unavailable
        except WeightSyncError as exc:
            return str(exc)

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[RemoteWindow]:
        reply = self._call("POST", "/admin/weights/window", OpenWindow(spec), WindowReply)
        window = RemoteWindow(self, reply.token, spec)
        try:
            yield window
        except BaseException:
            try:
                self._call(
                    "POST",
                    "/admin/weights/window/close",
                    CloseWindow(reply.token, False),
                    WindowReply,
                )
            except WeightSyncError:
                pass  # it timed out or died: it dropped the push itself
            raise
        self._call(
            "POST", "/admin/weights/window/close", CloseWindow(reply.token, True), WindowReply
        )

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, message, expect: type):
        try:
            r = self._client.request(
                method,
                path,
                content=None if message is None else WINDOW.encode(message),
                headers={"content-type": MEDIA_TYPE},
            )
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{self.url} unreachable ({type(exc).__name__}: {exc})") from None
        if r.headers.get("content-type", "").split(";")[0] != MEDIA_TYPE:
            raise WeightSyncError(f"{self.url}{path} answered {r.status_code}: {r.text[:300]}")
        answer = WINDOW.decode(r.content)
        if isinstance(answer, WindowReply) and answer.error is not None:
            raise WeightSyncError(f"{self.url}: {answer.error}")
        if not isinstance(answer, expect):
            raise WeightSyncError(f"{self.url}{path} sent {type(answer).__name__}")
        return answer


class RemoteWindow:
    """A window held open on one server (`tandem.exchange.UpdateWindow`)."""

    def __init__(self, replica: RemoteTarget, token: str, spec: UpdateSpec):
        self.replica = replica
        self.token = token
        self.spec = spec
        self._ingress: dict[int, tuple[int, float]] = {0: (0, 0.0)}

    def expose(self) -> None:
        self.replica._call("POST", "/admin/weights/window/expose", Expose(self.token), WindowReply)

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        ranks = 1 + max(records_by_rank, default=-1)
        records = [records_by_rank.get(rank, []) for rank in range(ranks)]
        reply = self.replica._call(
            "POST",
            "/admin/weights/window/phase",
            RunPhase(self.token, phase, self.spec, records),
            WindowReply,
        )
        if reply.ingress is not None:
            self._ingress = {r: (n, s) for r, n, s in reply.ingress}
        return reply.nbytes

    def ingress(self) -> dict[int, tuple[int, float]]:
        return self._ingress

    def failures(self) -> dict[int, str]:
        return {}  # a failure raises

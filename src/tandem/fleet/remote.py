"""A `tandem serve` as a `WeightTarget` for the router's exchange server: its ranks' layouts
and a push window held open on it, over its admin routes (`/admin/weights/target`,
`/admin/weights/window...`, messages in `tandem.fleet.window_messages`). The router makes a
`FleetTarget` of these, so one push through the router plans trainer ranks -> every replica's
ranks at once, sends each byte once and relays it, and commits on every replica or none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.fleet.window_messages import (
    MEDIA_TYPE,
    WINDOW,
    CloseWindow,
    Expose,
    OpenWindow,
    RunPhase,
    TargetInfo,
    WindowReply,
)


class RemoteReplica:
    """One `tandem serve` (started with the router's admin key)."""

    receivers_in_process = False

    def __init__(self, url: str, admin_key: str, timeout_s: float = 600.0):
        self.url = url
        self.update_listeners: list = []
        self._client = httpx.Client(base_url=url, timeout=timeout_s,
                                    headers={"authorization": f"Bearer {admin_key}"})  # fmt: skip
        self._info: TargetInfo | None = None

    def info(self, fresh: bool = True) -> TargetInfo:
        if fresh or self._info is None:
            self._info = self._call("GET", "/admin/weights/target", None, TargetInfo)
        return self._info

    @property
    def weight_version(self) -> int:
        return self.info().version

    @property
    def weight_dtype(self) -> str:
        return self.info(fresh=False).dtype

    @property
    def weight_device_type(self) -> str:
        return self.info(fresh=False).device_type

    def refuses(self, settings: PushSettings) -> str | None:
        if self.info(fresh=False).replicas > 1:
            return (f"{self.url} serves a fleet of its own (--data-parallel-size > 1): push "
                    "to it directly, or route over single-replica servers")  # fmt: skip
        return None

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
                self._call("POST", "/admin/weights/window/close",
                           CloseWindow(reply.token, False), WindowReply)  # fmt: skip
            except WeightSyncError:
                pass  # it timed out or died: it dropped the push itself
            raise
        self._call("POST", "/admin/weights/window/close", CloseWindow(reply.token, True),
                   WindowReply)  # fmt: skip

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, message, expect: type):
        try:
            r = self._client.request(
                method, path, content=None if message is None else WINDOW.encode(message),
                headers={"content-type": MEDIA_TYPE},
            )  # fmt: skip
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

    def __init__(self, replica: RemoteReplica, token: str, spec: UpdateSpec):
        self.replica = replica
        self.token = token
        self.spec = spec
        self._ingress: dict[int, tuple[int, float]] = {0: (0, 0.0)}

    def expose(self) -> None:
        self.replica._call("POST", "/admin/weights/window/expose", Expose(self.token),
                           WindowReply)  # fmt: skip

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        ranks = 1 + max(records_by_rank, default=-1)
        records = [records_by_rank.get(rank, []) for rank in range(ranks)]
        reply = self.replica._call("POST", "/admin/weights/window/phase",
                                   RunPhase(self.token, phase, self.spec, records),
                                   WindowReply)  # fmt: skip
        if reply.ingress is not None:
            self._ingress = {r: (n, s) for r, n, s in reply.ingress}
        return reply.nbytes

    def ingress(self) -> dict[int, tuple[int, float]]:
        return self._ingress

    def failures(self) -> dict[int, str]:
        return {}  # a failure raises

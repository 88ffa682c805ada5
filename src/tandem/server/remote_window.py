"""A push window on this server's target, held open for a front that runs the push elsewhere
(`tandem router`: its exchange server plans and drives every replica's phases).

`WeightTarget.weight_update` is a context manager: the window is entered and left on a thread
of its own (`_Held`), which runs the front's commands in order. At most one window is open at a
time. A front that goes quiet for ``idle_timeout_s`` (dead, partitioned) has its window closed
as failed: every rank drops what the push held, and the engine goes on serving what it served
(or refuses requests, if bytes already went into its live weights).

`target_info` and `answer` are the routes' work (`tandem serve`'s admin routes, and ``vllm
serve``'s through tandem's middleware): what the target holds, and a front's message carried
out on the host.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable

from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import UpdateSpec
from tandem.fleet.window_messages import (
    CloseWindow,
    Expose,
    OpenWindow,
    Refusal,
    Refuses,
    RunPhase,
    TargetInfo,
    WindowReply,
)

_CLOSE_OK, _CLOSE_FAILED = "close-ok", "close-failed"


class WindowError(RuntimeError):
    """No such window, or one is already open."""


class WindowHost:
    def __init__(self, target, idle_timeout_s: float = 600.0):
        self.target = target
        self.idle_timeout_s = idle_timeout_s
        self._held: _Held | None = None
        self._lock = threading.Lock()

    def open(self, spec: UpdateSpec) -> str:
        """Open a window for ``spec`` (waits for the steps in flight); its token. Raises what
        opening raised (a dead engine, say), or WindowError if one is open."""
        with self._lock:
            if self._held is not None and not self._held.closed.is_set():
                raise WindowError("another push window is open on this server")
            held = _Held(self.target, spec, self.idle_timeout_s)
            self._held = held
        held.start()
        held.opened.wait()
        if held.error is not None:
            raise held.error
        return held.token

    def run(self, token: str, call: Callable):
        """``call(update)`` inside the window; its result (its exception raised here)."""
        return self._get(token).do(call)

    def is_open(self, token: str) -> bool:
        """Whether the window ``token`` names is still open (not closed, not timed out)."""
        try:
            self._get(token)
        except WindowError:
            return False
        return True

    def close(self, token: str, ok: bool) -> None:
        """Leave the window: committed (``ok``) or failed (every rank drops what it held).
        Raises what leaving raised."""
        held = self._get(token)
        held.commands.put(_CLOSE_OK if ok else _CLOSE_FAILED)
        held.closed.wait()
        if ok and held.error is not None:
            raise held.error

    def _get(self, token: str) -> _Held:
        held = self._held
        if held is None or not secrets.compare_digest(held.token, token) or held.closed.is_set():
            raise WindowError("no such push window (closed, timed out, or never opened)")
        return held


class _Held(threading.Thread):
    def __init__(self, target, spec: UpdateSpec, idle_timeout_s: float):
        super().__init__(name="tandem-remote-window", daemon=True)
        self.target = target
        self.spec = spec
        self.idle_timeout_s = idle_timeout_s
        self.token = secrets.token_hex(16)
        self.commands: queue.Queue = queue.Queue()
        self.opened = threading.Event()
        self.closed = threading.Event()
        self.error: BaseException | None = None

    def do(self, call: Callable):
        answer: queue.Queue = queue.Queue(maxsize=1)
        self.commands.put((call, answer))
        result, error = answer.get()
        if error is not None:
            raise error
        return result

    def run(self) -> None:
        try:
            with self.target.weight_update(self.spec) as update:
                self.opened.set()
                while True:
                    try:
                        command = self.commands.get(timeout=self.idle_timeout_s)
                    except queue.Empty:
                        raise WeightSyncError(
                            f"the front running this push went quiet for {self.idle_timeout_s} s"
                        ) from None
                    if command == _CLOSE_OK:
                        break
                    if command == _CLOSE_FAILED:
                        raise WeightSyncError("the front running this push aborted it")
                    call, answer = command
                    try:
                        answer.put((call(update), None))
                    except Exception as exc:
                        answer.put((None, exc))
        except BaseException as exc:
            self.error = exc
        finally:
            self.opened.set()
            self.closed.set()
            while not self.commands.empty():  # a call that raced the close: answer it
                command = self.commands.get_nowait()
                if isinstance(command, tuple):
                    command[1].put((None, WindowError("the push window closed")))


def target_info(target, replicas: int = 1) -> TargetInfo:
    """What a front asks first of a server's target (``GET /admin/weights/target``):
    ``replicas``: how many the server runs (a fleet of its own when > 1)."""
    return TargetInfo(
        target.weight_version,
        target.weight_dtype,
        target.weight_device_type,
        target.weight_layouts(),
        replicas,
        target.unavailable(),
        target.weight_base,
    )


def answer(
    host: WindowHost, message: Refuses | OpenWindow | RunPhase | Expose | CloseWindow
) -> WindowReply | Refusal:
    """A front's message carried out on ``host`` (blocking: run it off the event loop); what
    failed is named in the reply's ``error``."""
    if isinstance(message, Refuses):
        return Refusal(host.target.refuses(message.settings))
    try:
        if isinstance(message, OpenWindow):
            return WindowReply(token=host.open(message.spec))
        if isinstance(message, RunPhase):

            def phase(update):
                update.spec = message.spec
                nbytes = update.run(message.phase, dict(enumerate(message.records)))
                return nbytes, [(r, n, s) for r, (n, s) in update.ingress().items()]

            nbytes, ingress = host.run(message.token, phase)
            return WindowReply(nbytes=nbytes, ingress=ingress)
        if isinstance(message, Expose):
            host.run(message.token, lambda update: update.expose())
        else:
            host.close(message.token, message.ok)
        return WindowReply()
    except Exception as exc:  # a busy or dead engine, a failed phase: say why
        opening = isinstance(message, OpenWindow)  # a phase's error names itself
        return WindowReply(f"{type(exc).__name__}: {exc}" if opening else str(exc))


def status(reply: WindowReply | Refusal) -> int:
    """The HTTP status a reply goes with: 409 where it names an error."""
    return 409 if isinstance(reply, WindowReply) and reply.error is not None else 200

"""A push window on this server's target, held open for a front that runs the push elsewhere
(`tandem router`: its exchange server plans and drives every replica's phases).

`WeightTarget.weight_update` is a context manager: the window is entered and left on a thread
of its own (`_Held`), which runs the front's commands in order. At most one window is open at a
time. A front that goes quiet for ``idle_timeout_s`` (dead, partitioned) has its window closed
as failed: every rank drops what the push held, and the engine goes on serving what it served
(or refuses requests, if bytes already went into its live weights).
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable

from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import UpdateSpec

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

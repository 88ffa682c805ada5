"""A steady request load for the fleet benches (`tandem bench fleet --rolling`, `--into
vllm`): client threads each looping one call, a wait for every replica to serve a version,
and pushes back to back over a window."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable


class ClientLoad:
    """``clients`` threads, client ``c`` looping ``call(c, rng)`` (its own seeded ``rng``; the
    call returns the tokens it got) until `stop`: each finished call's tokens with its finish
    time; a call that raises is counted in ``failed`` and the load goes on."""

    def __init__(self, clients: int, call: Callable[[int, random.Random], int]):
        self.done: list[tuple[float, int]] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(call, c), daemon=True, name=f"client-{c}")
            for c in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, call: Callable[[int, random.Random], int], client: int) -> None:
        rng = random.Random(client)
        while not self._stop.is_set():
            try:
                tokens = call(client, rng)
            except Exception as exc:  # counted; the load goes on
                self.failed.append(f"{type(exc).__name__}: {exc}")
                continue
            self.done.append((time.monotonic(), tokens))

    def tokens_per_s(self, start: float, end: float) -> float:
        """Tokens of the calls that finished in [start, end), per second."""
        tokens = sum(n for t, n in list(self.done) if start <= t < end)
        return tokens / (end - start)

    def stop(self, timeout_s: float) -> None:
        """Once every call under way has finished (each client thread waited ``timeout_s``)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)


def wait_serving(
    state: Callable[[], list[dict]], version: int, timeout_s: float, poll_s: float
) -> None:
    """Until every replica in ``state()`` (`fleet_state`'s rows, asked every ``poll_s``)
    serves ``version`` or newer; RuntimeError naming their states past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = state()
        if all(s["state"] == "serving" and s["version"] >= version for s in rows):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fleet did not reach version {version}: {rows}")
        time.sleep(poll_s)


def back_to_back(
    push: Callable[[int], None], window_s: float, version: int
) -> tuple[float, float, int, list[float]]:
    """``push(v)`` (returning once every replica serves v) for versions ``version``, +1, ...
    back to back until ``window_s`` has passed: (start, end, the next version, seconds per
    push)."""
    seconds = []
    start = time.monotonic()
    while time.monotonic() - start < window_s:
        t0 = time.monotonic()
        push(version)
        seconds.append(time.monotonic() - t0)
        version += 1
    return start, time.monotonic(), version, seconds

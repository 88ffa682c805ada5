"""Waiting on a condition with a deadline (never a sleep as synchronization)."""

from __future__ import annotations

import time


def until(what: str, ok, timeout_s: float, poll_s: float = 0.005):
    """``ok()``'s first truthy value; AssertionError naming ``what`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := ok():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} did not happen within {timeout_s:g} s")

"""Faults injected where a `WeightSender` meets the wire, for the trainer scripts the tests run
(tests/support/fsdp_trainer.py, rolling_trainer.py, http_trainer.py).

A push on one trainer rank: hello, the engine's `PushPlan`, the rank's transport delivers the
boxes the plan names, `PushReady` (checksums, staging handle), the engine's answer. These
functions patch the frame functions `tandem.exchange.sender` calls (its ``send_frame`` and
``recv_frame``), so the sender and its transport run unchanged around the fault. Call them in
the process that pushes, before `WeightSender.push`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from tandem.exchange import sender
from tandem.exchange.protocol import PUSH, PushPlan, PushReady
from tandem.exchange.transports.memory import MappedMemory

DIED = 17  # the exit code of a trainer killed mid-push


def die_before_ready() -> None:
    """Exit (code `DIED`, no clean-up) once the boxes are delivered (staged, written in place
    or sent), before the engine is told they are ready."""
    _before_ready(lambda _ready: os._exit(DIED))


def corrupt_staging() -> None:
    """Flip the first staged byte after its checksum was taken, mapped as the engine maps it
    (staged pushes whose staging memory the engine maps: shm, cuda_ipc); then tell the engine
    the push is ready."""

    def flip(ready: PushReady) -> None:
        if ready.staging is not None:
            MappedMemory(ready.staging).data[:1] ^= 0xFF

    _before_ready(flip)


def deliver_to_first_engine_rank() -> None:
    """The plan this rank receives keeps only the boxes for the first engine rank it names
    (the smallest ``dst``), so the transport delivers those alone (dist: the other engine
    ranks wait for boxes that never come)."""
    honest = sender.recv_frame

    def recv_frame(sock, *args, **kwargs):
        frame = honest(sock, *args, **kwargs)
        plan = PUSH.decode(frame)
        if not isinstance(plan, PushPlan) or not plan.items:
            return frame
        first = min(item.dst for item in plan.items)
        items = [item for item in plan.items if item.dst == first]
        return PUSH.encode(dataclasses.replace(plan, items=items))

    sender.recv_frame = recv_frame


def _before_ready(fault: Callable[[PushReady], None]) -> None:
    """``fault(ready)`` just before this rank's `PushReady` is sent."""
    honest = sender.send_frame

    def send_frame(sock, data, *args, **kwargs):
        ready = PUSH.decode(data)
        if isinstance(ready, PushReady):
            fault(ready)
        return honest(sock, data, *args, **kwargs)

    sender.send_frame = send_frame

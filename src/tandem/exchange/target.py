"""What a push needs of whatever it updates (`WeightTarget`), and of the window one push runs
in (`UpdateWindow`). The exchange server (`tandem.exchange.server`) and `WeightSender` use
only these members: one engine implements them (`tandem.engine.engine_target`), and so can a
fleet of engines behind one front or another project's engine.

Receiving ranks are numbered across the whole target, ``0 .. len(weight_layouts()) - 1``: the
plan, the records by rank and every phase use that numbering, however the target spreads its
ranks over engines and processes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import AdapterPush, AdapterSlot, PushPhase, PushSettings, UpdateSpec

# called after every push: (the version pushed, -1 if unknown; seconds it took; the error, or
# None when it was committed)
UpdateListener = Callable[[int, float, str | None], None]


@runtime_checkable
class UpdateWindow(Protocol):
    """One push, open on the target: no step runs on the receiving ranks until it closes.
    Leaving the window with an exception aborts the push on every rank."""

    spec: UpdateSpec  # the spec the phases run with (the server adds the senders' staging)

    def expose(self) -> None:
        """From now on bytes may land in the live parameters (``in_place`` delivery begins):
        a failure leaves the target refusing requests until a complete push lands."""

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        """``phase`` on every receiving rank, each finishing before any starts the next; the
        bytes they moved. Raises `WeightSyncError` (saying what still serves) on any error."""

    def ingress(self) -> dict[int, tuple[int, float]]:
        """Per replica (`RankLayout.replica`; a single engine is replica 0): the bytes that
        arrived at its ranks in this push (received, else copied in from the senders' staging
        at commit) and the seconds from opening the window to its last phase."""

    def failures(self) -> dict[int, str]:
        """The replicas that left the push and why (a fleet goes on without a replica that
        fails while others pass; one engine raises instead, so it reports none)."""


@runtime_checkable
class WeightTarget(Protocol):
    """Whatever a push updates: its receiving ranks and the window a push runs in."""

    @property
    def weight_version(self) -> int:
        """The version the target serves (committed; a fleet: the newest any replica holds).
        A push without one gets this + 1; one naming a version not above it is refused
        (`tandem.errors.StaleVersionError`) unless it is a rollback."""

    @property
    def weight_base(self) -> str | None:
        """The id of the push (`UpdateSpec.push_id`) whose weights every receiving rank holds,
        untouched since; None where that is not known (weights loaded from disk, reloaded,
        released by sleep, torn, or pushed by other means). A delta push needs its trainers'
        base here (`tandem.exchange.delta`); any other goes dense."""

    @property
    def weight_dtype(self) -> str:
        """The dtype its ranks hold weights in (a name in `tandem.dtypes.DTYPES`): senders
        convert to it."""

    @property
    def weight_device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: where its ranks hold weights (which transports reach
        them, and the dist transport's backend)."""

    @property
    def receivers_in_process(self) -> bool:
        """Whether some receiving rank lives in the process that holds this object (CUDA IPC
        cannot map memory into the process that made it)."""

    @property
    def update_listeners(self) -> list[UpdateListener]:
        """Called after every push, committed or not."""

    def refuses(self, settings: PushSettings) -> str | None:
        """Why the target cannot take a push travelling with ``settings`` (said before any
        byte moves), or None."""

    def weight_layouts(self) -> list[RankLayout]:
        """What every receiving rank holds, as canonical boxes (``layouts[i].rank == i``)."""

    def weight_update(self, spec: UpdateSpec) -> AbstractContextManager[UpdateWindow]:
        """Open the window for one push (waits for the steps in flight)."""

    def unavailable(self) -> str | None:
        """Why the target refuses every request now (dead, torn weights, none loaded), or
        None; for the messages of a failed push."""


@runtime_checkable
class AdapterTarget(Protocol):
    """What a target that takes LoRA adapter pushes (`PushSettings.adapter`) has beside the
    `WeightTarget` members: an engine with ``enable_lora``. Any other target refuses them."""

    def adapter_plan(self, push: AdapterPush) -> tuple[list[RankLayout], AdapterSlot, int | None]:
        """The receiving layouts of the slot the adapter's push lands in, that slot, and the
        adapter's latest version (None: none is loaded; a push naming no version gets the
        latest + 1, else 1; one naming a version not above the latest is refused unless it is
        a rollback). Only asked where `refuses` let the push through."""


@runtime_checkable
class ReplicatedTarget(Protocol):
    """What a target of several replicas (a fleet) has beside the `WeightTarget` members: a
    delta push goes to the replicas holding its base while the others catch up from a peer."""

    def plan_over_base(self, base: str) -> bool:
        """The push about to be planned is a delta from push ``base`` (`WeightTarget.
        weight_base`), which some member replicas do not hold: plan it over those that do
        (its layouts, its window, `weight_base`); the others are left out and, once it
        lands, take a dense copy from a replica that took it. False (nothing changes: the
        push goes dense to all) where no member holds ``base`` or the target cannot fill a
        replica from a peer. Asked after `refuses`, before `weight_layouts`."""

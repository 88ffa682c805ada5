"""What a `Fleet` needs of a replica (`Replica`), and what a replica says of itself
(`Health`). Three kinds: an engine in this process (`tandem.fleet.local`), and a `tandem
serve` or a ``vllm serve`` reached over HTTP (`tandem.fleet.remote`); the fleet knows no
other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.exchange.target import WeightTarget


@dataclass(frozen=True, slots=True)
class Health:
    """A replica as last seen.

    ``ok``: it may take requests (a remote one answered its health check).
    ``version``: the weights it serves.
    ``fault``: why it must be quarantined (dead, torn), or None; a replica merely not ok
    (unreachable) is only skipped, and rejoins as it is if its version is current.
    ``reason``: why it is not ok, or None.
    ``updating``: a push's window is open on it (every replica's, with policy "all").
    """

    ok: bool
    version: int
    fault: str | None = None
    reason: str | None = None
    updating: bool = False


class Replica(Protocol):
    """One replica of a fleet."""

    name: str  # how messages and reports name it ("replica 2", its URL)
    kind: str  # what serves it ("engine", "tandem serve", "vllm serve"): a fleet is of one kind
    block: int  # the prefix block routing hashes, in the replica's units
    cache_blocks: int  # how many prompt blocks its prefix index remembers
    # a rolling wave may refill it in place from a peer (`Fleet`'s in-place waves): both ends
    # run in this process
    in_process: bool

    @property
    def target(self) -> WeightTarget:
        """What a push into this replica updates."""
        ...

    @property
    def version(self) -> int:
        """The weights it serves, as last seen (cheap)."""
        ...

    def health(self) -> Health:
        """How it stands now, from what is known (cheap: called on every routing)."""
        ...

    def refresh(self) -> None:
        """Look again (blocking: a remote replica's health check)."""
        ...

    def busy(self) -> bool | None:
        """Whether it runs a request (a rolling wave's drain), or None where only the
        fleet's ledger knows (a remote replica)."""
        ...

    def lost(self, reason: str) -> bool:
        """It failed a request (``reason``): whether the fleet quarantines it (its requests
        died with it, and it is still faulty), or it is only skipped until it answers again
        (unreachable)."""
        ...

    def receive_address(self) -> str:
        """Where a peer pushes into it."""
        ...

    def send_to(self, other: Replica, timeout_s: float) -> int:
        """Push its weights, at its version, into ``other`` (serving nothing meanwhile),
        planned and CRC-checked like any push; the version sent. Raises naming what failed."""
        ...

    def paused(self) -> str | None:
        """Its pause mode, if paused (a healed replica copies its peer's)."""
        ...

    def pause(self, mode: str) -> None: ...

    def restarted(self) -> Replica | None:
        """A fresh replica in its place if its workers are gone (reading nothing from disk,
        to be filled from a peer); None if it needs none, or the fleet cannot restart it (a
        remote one heals once it answers again)."""
        ...

    def report(self) -> dict:
        """What a state report adds for this kind of replica (a remote one's URL)."""
        ...

    def close(self) -> None: ...

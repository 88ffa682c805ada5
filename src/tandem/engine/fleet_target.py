"""A fleet of engines as one `WeightTarget`: one push updates every replica.

The fleet's receiving ranks are its replicas' ranks numbered one after another, each layout
saying its replica (`RankLayout.replica`), so the planner sends every byte once and relays it
from replica to replica (`tandem.exchange.plan.plan_fleet`). A push opens every replica's
window; each phase runs on all replicas at once (a relay needs both of its ends), and every
replica verifies before any commits: a replica that rejects the push makes the whole fleet
keep the version it serves.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.exchange.target import UpdateListener, UpdateWindow


class FleetTarget:
    """The replicas of one fleet as a push target: each a `WeightTarget` of its own (an
    `LLMEngine`, or a `tandem serve` behind `tandem router`). ``host``: where the fleet's
    exchange server listens for trainers."""

    def __init__(self, engines: list, host: str = "127.0.0.1"):
        self.engines = engines
        self.host = host
        self.update_listeners: list[UpdateListener] = []
        self._exchange = None
        self._first_ranks: list[int] = []

    def exchange_server(self):
        if self._exchange is None:
            from tandem.exchange.server import ExchangeServer

            self._exchange = ExchangeServer(self, host=self.host)
        return self._exchange

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()

    @property
    def weight_version(self) -> int:
        return min(engine.weight_version for engine in self.engines)

    @property
    def weight_dtype(self) -> str:
        return self.engines[0].weight_dtype

    @property
    def weight_device_type(self) -> str:
        return self.engines[0].weight_device_type

    @property
    def receivers_in_process(self) -> bool:
        return any(engine.receivers_in_process for engine in self.engines)

    def refuses(self, settings: PushSettings) -> str | None:
        if settings.in_place:
            return ("a fleet takes staged pushes: every replica stages and verifies the new "
                    "version before any commits it (mode='in_place' would write replicas' live "
                    "weights before the others had checked theirs)")  # fmt: skip
        for r, engine in enumerate(self.engines):
            if (why := engine.refuses(settings)) is not None:
                return f"replica {r}: {why}"
        return None

    def weight_layouts(self) -> list[RankLayout]:
        """Every replica's ranks, numbered one after another (the numbering the push's
        records then use: kept until the next call)."""
        per_replica = [engine.weight_layouts() for engine in self.engines]
        self._first_ranks = [sum(len(lays) for lays in per_replica[:r])
                             for r in range(len(per_replica))]  # fmt: skip
        return [dataclasses.replace(lay, rank=first + lay.rank, replica=r)
                for r, (lays, first) in enumerate(zip(per_replica, self._first_ranks,
                                                      strict=True))
                for lay in lays]  # fmt: skip

    def unavailable(self) -> str | None:
        reasons = [f"replica {r}: {why}" for r, engine in enumerate(self.engines)
                   if (why := engine.unavailable()) is not None]  # fmt: skip
        return "; ".join(reasons) or None

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[FleetUpdate]:
        """Every replica's window, opened in replica order; an error in any closes them all
        with it (each replica drops what the push left on it)."""
        with ExitStack() as stack:
            windows = [stack.enter_context(engine.weight_update(self._replica_spec(spec, r)))
                       for r, engine in enumerate(self.engines)]  # fmt: skip
            yield FleetUpdate(self, spec, windows)

    def _replica_spec(self, spec: UpdateSpec, replica: int) -> UpdateSpec:
        return dataclasses.replace(spec, first_rank=self._first_ranks[replica])

    def split(self, records_by_rank: dict[int, list[Record]]) -> list[dict[int, list[Record]]]:
        """Fleet-wide rank -> records, as each replica's own rank -> records."""
        out: list[dict[int, list[Record]]] = [{} for _ in self.engines]
        bounds = [*self._first_ranks, float("inf")]
        for rank, records in records_by_rank.items():
            r = next(i for i in range(len(self.engines)) if rank < bounds[i + 1])
            out[r][rank - self._first_ranks[r]] = records
        return out


class FleetUpdate:
    """One push's window on every replica (`tandem.exchange.UpdateWindow`)."""

    def __init__(self, target: FleetTarget, spec: UpdateSpec, windows: list[UpdateWindow]):
        self.target = target
        self.windows = windows
        self._spec = spec

    @property
    def spec(self) -> UpdateSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: UpdateSpec) -> None:
        self._spec = spec
        for r, window in enumerate(self.windows):
            window.spec = self.target._replica_spec(spec, r)

    def expose(self) -> None:
        for window in self.windows:
            window.expose()

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        """``phase`` on every replica at once (a relay's two ends take part together); the
        bytes moved. Any replica's error fails the phase for the fleet, naming the replicas."""
        parts = self.target.split(records_by_rank)
        moved = [0] * len(self.windows)
        errors: dict[int, BaseException] = {}

        def one(r: int) -> None:
            try:
                moved[r] = self.windows[r].run(phase, parts[r])
            except BaseException as exc:
                errors[r] = exc

        threads = [threading.Thread(target=one, args=(r,), name=f"tandem-push-replica-{r}",
                                    daemon=True) for r in range(1, len(self.windows))]  # fmt: skip
        for t in threads:
            t.start()
        one(0)
        for t in threads:
            t.join()
        if errors:
            detail = "; ".join(f"replica {r}: {exc}" for r, exc in sorted(errors.items()))
            if phase is PushPhase.COMMIT:  # some replicas may hold the new version already
                raise WeightSyncError(f"the commit of version {self.spec.version} failed on "
                                      f"replicas {sorted(errors)}: {detail}")  # fmt: skip
            raise WeightSyncError(f"update to version {self.spec.version} rejected in "
                                  f"{phase.value} by replicas {sorted(errors)}; every replica "
                                  f"keeps the version it serves: {detail}")  # fmt: skip
        return sum(moved)

    def ingress(self) -> dict[int, tuple[int, float]]:
        return {r: window.ingress()[0] for r, window in enumerate(self.windows)}

"""Same-host transport through shared memory (`tandem.exchange.transports.memory`).

``staged``: each trainer rank packs its boxes into its own nameless shared staging memory
(kept for its later pushes); the engine ranks map it, check every box there, and copy it into
their parameters on commit. ``in_place``: the engine's parameters live in shared memory
(`ParamArena`, engines on CPU); while the engine is paused each trainer rank maps them and
writes every box straight into its live parameter, one copy, and the engine ranks check the
parameters.
"""

from __future__ import annotations

import torch

from tandem.dtypes import WIRE_DTYPES
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import PushPlan
from tandem.exchange.settings import UpdateSpec
from tandem.exchange.transports.base import (
    Coordinator,
    Delivery,
    ReceiverHalf,
    SenderHalf,
    Transport,
)
from tandem.exchange.transports.memory import MappedArena, MappedMemory, SharedMemory


class ShmSender(SenderHalf):
    def __init__(self, settings, device, rank):
        super().__init__(settings, device, rank)
        self.staging: SharedMemory | None = None  # staged: kept for the next push
        self._arenas: dict[tuple, MappedArena] = {}  # in_place: engine ranks' parameters

    def deliver(self, plan, tensors: dict[str, torch.Tensor]) -> Delivery:
        if self.settings.in_place:
            arenas = self._map_arenas(plan.arenas)
            targets = [
                item.dst_region.view(arenas[item.dst].param(item.dst_key, WIRE_DTYPES[item.dtype]))
                for item in plan.items
            ]
        else:
            if self.staging is None or self.staging.size != plan.size:
                self.staging = None  # the old memory goes before the new one is made
                self.staging = SharedMemory(plan.size, "tandem-staging")
            targets = self.staged(plan, self.staging.data)
        crcs, moved = self.write_items(plan, tensors, targets)
        staging = None if self.settings.in_place else self.staging.handle()
        return Delivery(crcs, moved, staging)

    def _map_arenas(self, wires: list) -> list[MappedArena]:
        """Each engine rank's arena, mapped once and kept for later pushes (a mapping of an
        engine that is gone is dropped)."""
        mapped = {}
        for wire in wires:
            key = tuple(wire[:3])
            mapped[key] = self._arenas.get(key) or MappedArena(wire)
        self._arenas = mapped
        return [mapped[tuple(wire[:3])] for wire in wires]

    def close(self) -> None:
        self.staging = None
        self._arenas = {}


class ShmReceiver(ReceiverHalf):
    def __init__(self, model, rank, device):
        super().__init__(model, rank, device)
        self._shared: dict[tuple, MappedMemory] = {}  # trainers' staging memory, mapped

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        if spec.settings.in_place:
            return self.live(records)
        segments = self._map(spec, {r.source for r in records})
        return [
            segments[r.source].tensor(r.offset, r.nbytes, WIRE_DTYPES[r.dtype]).view(r.box_shape)
            for r in records
        ]

    def _map(self, spec: UpdateSpec, sources: set[int]) -> dict[int, MappedMemory]:
        """The staging memory of each trainer rank in ``sources``: mapped once, kept while
        pushes keep naming it (the mapping of an older push's memory is dropped, which frees
        it once its trainer is gone)."""
        shared, out = {}, {}
        for i in sorted(sources):
            wire = spec.staging[i]
            key = tuple(wire[:3])
            shared[key] = self._shared.get(key) or MappedMemory(wire, "staging memory")
            out[i] = shared[key]
        self._shared = shared
        return out

    def abort(self, spec: UpdateSpec) -> None:
        self._shared = {}


class ShmCoordinator(Coordinator):
    def prepare(
        self, spec: UpdateSpec, plans: list[PushPlan], receivers: list[RankLayout], device_type: str
    ) -> UpdateSpec:
        """In place: every trainer rank gets every receiving rank's arena to write into."""
        if not spec.settings.in_place:
            return spec
        missing = [lay.rank for lay in receivers if lay.arena is None]
        if missing:
            raise ValueError(
                "mode='in_place' over shm needs every engine rank's parameters in shared "
                f"memory (an engine on CPU); ranks {missing} have none"
            )
        for plan in plans:
            plan.arenas = [lay.arena for lay in receivers]
        return spec


class ShmTransport(Transport):
    name = "shm"
    modes = ("staged", "in_place")
    sender = ShmSender
    receiver = ShmReceiver
    coordinator = ShmCoordinator
    shared_staging = True

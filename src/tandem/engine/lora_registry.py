"""Which LoRA adapter version sits in which slot of an engine (`tandem.layers.lora`), and the
receiving layouts of a push into a slot.

Every adapter enters through a push (`WeightSender` with ``lora_name``: from a trainer's PEFT
model, or from a PEFT directory or tensors in memory, which the engine pushes to itself), so
adapters are planned, moved and verified like weights. A push is planned into a slot
(`plan_push`): a new adapter takes a free slot, or evicts the least recently used adapter that
no request runs with and that can come back (loaded from a directory, or an older kept version);
a new version of an adapter takes a free slot while it keeps fewer than ``keep_versions`` versions,
else the slot of its oldest (requests still running on that version go on with the new one).
The slot's previous adapter leaves the registry when the push's window opens (`begin`: no step runs
then), so no new request pins it; the new version enters when the push commits (`committed`), and
a push that fails before writing the slot gives it back to what it held (`failed`).

Requests pin the latest version of their adapter (`pin`): its slot and prefix-cache key.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import LoRAConfig
from tandem.errors import LoRAError, LoRASlotsFull
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import AdapterPush, AdapterSlot
from tandem.layers.lora import slot_pieces


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """One adapter version in a slot. ``key``: its prefix-cache key; ``path``: the PEFT
    directory it was read from (None: pushed, or from memory)."""

    name: str
    version: int
    slot: int
    rank: int
    key: bytes
    int_id: int | None = None
    path: str | None = None
    order: int = 0  # commit order: the highest of a name is its latest version


class LoRARegistry:
    def __init__(self, config: LoRAConfig, busy_slots: Callable[[], set[int]]):
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self._busy_slots = busy_slots  # slots some unfinished request runs with
        self.slots: list[LoadedAdapter | None] = [None] * self.max_loras
        self._filling: dict[int, LoadedAdapter | None] = {}  # slot -> what it held before
        self._pins: Counter[int] = Counter()
        self._sources: dict[str, tuple[int | None, str | None]] = {}  # name -> (int id, path)
        self._order = itertools.count(1)
        self._used: dict[int, int] = {}  # slot -> last use (LRU eviction)

    # ----- requests -----
    def latest(self, name: str) -> LoadedAdapter | None:
        versions = self.versions(name)
        return versions[-1] if versions else None

    def versions(self, name: str) -> list[LoadedAdapter]:
        """The adapter's loaded versions, oldest first."""
        return sorted(
            (a for a in self.slots if a is not None and a.name == name), key=lambda a: a.order
        )

    def adapters(self) -> list[LoadedAdapter]:
        """The latest version of every loaded adapter, by name."""
        names = sorted({a.name for a in self.slots if a is not None})
        return [self.latest(n) for n in names]

    def pin(self, name: str) -> LoadedAdapter:
        """The latest version of adapter ``name``, held in its slot until `unpin`."""
        adapter = self.latest(name)
        if adapter is None:
            raise LoRAError(
                f"adapter {name!r} is not loaded (loaded: {[a.name for a in self.adapters()]})"
            )
        self._pins[adapter.slot] += 1
        self._used[adapter.slot] = next(self._order)
        return adapter

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def set_source(self, name: str, int_id: int | None, path: str | None) -> None:
        """Where the version of ``name`` being loaded comes from (its next commit records
        it; `drop_source` if the load fails)."""
        self._sources[name] = (int_id, path)

    def drop_source(self, name: str) -> None:
        self._sources.pop(name, None)

    def unload(self, name: str) -> None:
        versions = self.versions(name)
        if not versions:
            raise LoRAError(f"adapter {name!r} is not loaded")
        busy = self._busy()
        if any(a.slot in busy for a in versions):
            raise LoRAError(f"adapter {name!r} has requests running; unload it after them")
        for a in versions:
            self.slots[a.slot] = None
        self._sources.pop(name, None)

    def forget_all(self) -> None:
        """The ranks' slots were wiped (a reload, or sleep level 2)."""
        self.slots = [None] * self.max_loras

    # ----- pushes -----
    def plan_push(
        self, push: AdapterPush, layouts: list[RankLayout]
    ) -> tuple[list[RankLayout], AdapterSlot, int | None]:
        """The slot a push of ``push`` fills, the receiving layouts of that slot, and the
        adapter's latest version (None: none is loaded)."""
        if push.rank > self.max_rank:
            raise LoRAError(
                f"adapter {push.name!r}: rank {push.rank} is above max_lora_rank {self.max_rank}"
            )
        if not layouts or not any(lay.lora_sites for lay in layouts):
            raise LoRAError("this engine serves no LoRA adapters (start it with enable_lora)")
        slot = self.slot_for(push.name, push.keep_versions)
        versions = self.versions(push.name)
        latest = versions[-1].version if versions else None
        return (
            slot_layouts(layouts, slot, push, self.max_rank, self.max_loras),
            AdapterSlot(push.name, slot, push.scale, push.rank),
            latest,
        )

    def slot_for(self, name: str, keep_versions: int = 1) -> int:
        """The slot the next version of adapter ``name`` would take (`LoRASlotsFull` if
        none can)."""
        versions = self.versions(name)
        if len(versions) >= keep_versions:
            return versions[0].slot  # the oldest version kept gives way
        return self._free_slot(name)

    def begin(self, adapter: AdapterSlot) -> None:
        """A push into ``adapter.slot`` opens its window (no step runs): what the slot holds
        leaves the registry, so no new request pins it. Refused if another adapter took the
        slot since the push was planned and requests run with it."""
        before = self.slots[adapter.slot]
        if before is not None and before.name != adapter.name and adapter.slot in self._busy():
            raise LoRAError(
                f"adapter {adapter.name!r}: its slot {adapter.slot} was taken by "
                f"{before.name!r}, which requests run with; push again"
            )
        self._filling[adapter.slot] = before
        self.slots[adapter.slot] = None

    def committed(self, adapter: AdapterSlot, version: int) -> LoadedAdapter:
        """The push into ``adapter.slot`` landed: it serves ``version`` of the adapter now."""
        self._filling.pop(adapter.slot, None)
        # a load's source is its own: a trainer's later push of the name has none
        int_id, path = self._sources.pop(adapter.name, (None, None))
        order = next(self._order)
        key = hashlib.sha256(f"lora\0{adapter.name}\0{version}\0{order}".encode()).digest()
        loaded = LoadedAdapter(
            adapter.name, version, adapter.slot, adapter.rank, key, int_id, path, order
        )
        self.slots[adapter.slot] = loaded
        self._used[adapter.slot] = order
        return loaded

    def failed(self, adapter: AdapterSlot, intact: bool) -> None:
        """The push into ``adapter.slot`` did not land. ``intact``: nothing was written into
        the slot, which serves what it held before again; else it is empty."""
        before = self._filling.pop(adapter.slot, None)
        self.slots[adapter.slot] = before if intact else None

    def _busy(self) -> set[int]:
        return self._busy_slots() | set(self._pins)

    def _free_slot(self, name: str) -> int:
        taken = self._filling
        free = [s for s, a in enumerate(self.slots) if a is None and s not in taken]
        if free:
            return free[0]
        busy = self._busy()
        latest = {a.name: a for a in self.adapters()}
        # may go: nobody runs with it, and it can come back (read from a directory) or it
        # is not its adapter's latest version
        evictable = [
            a
            for a in self.slots
            if a is not None
            and a.slot not in busy
            and a.slot not in taken
            and (a.path is not None or latest[a.name] is not a)
        ]
        if not evictable:
            held = sorted({a.name for a in self.slots if a is not None})
            raise LoRASlotsFull(
                f"adapter {name!r}: all max_loras={self.max_loras} slots hold "
                f"adapters in use or pushed ({held}); unload one or raise "
                "max_loras"
            )
        victim = min(evictable, key=lambda a: self._used.get(a.slot, 0))
        return victim.slot


def slot_layouts(
    layouts: list[RankLayout], slot: int, push: AdapterPush, max_rank: int, slots: int
) -> list[RankLayout]:
    """Every rank's receiving layout for an adapter push into ``slot``: the canonical A and B
    of each target module, placed in that slot's tensors (`tandem.layers.lora.slot_pieces`)."""
    out = []
    for lay in layouts:
        mine = RankLayout(lay.rank, dtype=lay.dtype, arena=lay.arena, replica=lay.replica)
        for site in lay.lora_sites:
            tensors = slot_pieces(site, slot, push.rank, max_rank, push.targets, slots)
            for key, shape, pieces in tensors:
                if pieces:
                    mine.add(key, shape, pieces)
        out.append(mine)
    return out

"""The planner: from every sender's and receiver's layout to the list of transfers.

Pure and blind to transports: every element of every receiver region comes from exactly one
sender region; where several senders hold the same elements (data-parallel replicas, replicated
tensors) each piece goes to the least-loaded of them, so bytes spread across senders. The order
is deterministic; `PlanCache` computes a plan once per pair of layouts.

Receivers may be a fleet: replicas (`RankLayout.replica`) that each need every byte. The
trainers send each byte once, to the first replica of each distinct layout; every other
replica gets its bytes by relay (`Relay`) from the replica before it with the same layout, a
chain in which each replica's rank j passes rank j of the next what it received: every link
carries one copy, and the trainers' egress stays one copy whatever the number of replicas.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import msgpack

from tandem.exchange.layout import LayoutMismatch, RankLayout, Region, layout_problems
from tandem.layers.placement import Piece

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Move canonical ``box`` of tensor ``name`` from a sender region to a receiver region."""

    src: int
    dst: int
    name: str
    box: Box
    src_key: str
    src_piece: Piece
    dst_key: str
    dst_piece: Piece

    @property
    def numel(self) -> int:
        return numel(self.box)


@dataclass(frozen=True, slots=True)
class Relay:
    """Receiving rank ``src`` passes receiving rank ``dst`` the box of ``transfers[seed]``
    (``dst`` holds it in the same parameter and region as ``src``), once it landed on ``src``."""

    seed: int
    src: int
    dst: int


@dataclass(slots=True)
class Plan:
    transfers: list[Transfer]
    num_senders: int
    num_receivers: int
    sender_numel: list[int] = field(default_factory=list)
    relays: list[Relay] = field(default_factory=list)  # in relay order along each chain
    # what users of the plan derive from it once (the exchange server's per-push items),
    # cached with it
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def for_receiver(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]

    @property
    def total_numel(self) -> int:
        return sum(self.sender_numel)

    @property
    def sender_max_over_mean(self) -> float:
        busy = self.sender_numel
        mean = sum(busy) / len(busy)
        return max(busy) / mean if mean else 1.0


MIN_BAND_NUMEL = 1 << 20  # cells smaller than two of these go whole to one holder


def plan_transfers(
    senders: list[RankLayout],
    receivers: list[RankLayout],
    ignore: frozenset[str] = frozenset(),
    min_band_numel: int = MIN_BAND_NUMEL,
) -> Plan:
    """The transfers; every layout problem (names, shapes, uncovered boxes) raised at once.
    Sender tensors named in ``ignore`` are not sent (a trainer's value head, say).

    A cell several senders hold goes to the least-loaded of them; a large one (at least two
    ``min_band_numel`` elements) is first cut into bands of its first dimension, one per
    holder at most, so replicas share it."""
    problems = layout_problems(senders, receivers, ignore)
    # tensor name -> box -> the (rank, region)s holding exactly that box (replicas)
    holders: dict[str, dict[Box, list[tuple[int, Region]]]] = defaultdict(dict)
    for layout in sorted(senders, key=lambda lay: lay.rank):
        for region in layout.regions:
            holders[region.piece.name].setdefault(region.piece.box, []).append(
                (layout.rank, region)
            )
    # (group, band, receiver rank, name, region) per transfer, in receiver order
    wanted: list[tuple[list, Box, int, str, Region]] = []
    for layout in sorted(receivers, key=lambda lay: lay.rank):
        for region in layout.regions:
            name, dst_box = region.piece.name, region.piece.box
            groups = holders.get(name, {})
            if len(groups) == 1 and _contains(box := next(iter(groups)), dst_box):
                covered = [(dst_box, groups[box])]  # the common case: one box (and replicas)
            else:
                covered = _covered(groups, dst_box, name, layout.rank, problems)
            for cell, group in covered:
                for band in _bands(cell, len(group), min_band_numel):
                    wanted.append((group, band, layout.rank, name, region))
    if problems:
        raise LayoutMismatch(problems)
    # Balance: loads that have no choice (one holder) first, then the shared cells largest
    # first, each to its least-loaded holder (LPT), so the fixed loads are known before any
    # choice is made. Transfers keep the receivers' order.
    balance = _Balance()
    transfers: list[Transfer | None] = [None] * len(wanted)
    shared = []
    for i, (group, band, dst, name, region) in enumerate(wanted):
        if len(group) == 1:
            rank, src = group[0]
            balance.load[rank] += numel(band)
            transfers[i] = Transfer(rank, dst, name, band, src.key, src.piece, region.key,
                                    region.piece)  # fmt: skip
        else:
            shared.append((-numel(band), i))
    shared.sort()
    for size, i in shared:
        group, band, dst, name, region = wanted[i]
        rank, src = balance.take(group, -size)
        transfers[i] = Transfer(rank, dst, name, band, src.key, src.piece, region.key,
                                region.piece)  # fmt: skip
    num_senders = max((lay.rank for lay in senders), default=-1) + 1
    loads = [balance.load[r] for r in range(num_senders)]
    return Plan(transfers, num_senders, max((lay.rank for lay in receivers), default=-1) + 1, loads)


def plan_fleet(
    senders: list[RankLayout],
    receivers: list[RankLayout],
    ignore: frozenset[str] = frozenset(),
    min_band_numel: int = MIN_BAND_NUMEL,
) -> Plan:
    """`plan_transfers` into the first replica of each distinct receiver layout, and relays
    to the others: replica k's rank j gets every box of the replica before it (same layout)
    from that replica's rank j. One replica: `plan_transfers` itself."""
    replicas: dict[int, list[RankLayout]] = defaultdict(list)
    for layout in sorted(receivers, key=lambda lay: lay.rank):
        replicas[layout.replica].append(layout)
    if len(replicas) <= 1:
        return plan_transfers(senders, receivers, ignore, min_band_numel)
    chains: dict[str, list[list[RankLayout]]] = {}  # local layout -> its replicas, in order
    for replica in sorted(replicas):
        chains.setdefault(_local_fingerprint(replicas[replica]), []).append(replicas[replica])
    seeds = [lay for chain in chains.values() for lay in chain[0]]
    plan = plan_transfers(senders, seeds, ignore, min_band_numel)
    plan.num_receivers = max(lay.rank for lay in receivers) + 1
    local = {lay.rank: j for chain in chains.values() for j, lay in enumerate(chain[0])}
    for chain in chains.values():
        firsts = {lay.rank for lay in chain[0]}
        for upstream, downstream in itertools.pairwise(chain):
            plan.relays.extend(
                Relay(i, upstream[local[t.dst]].rank, downstream[local[t.dst]].rank)
                for i, t in enumerate(plan.transfers) if t.dst in firsts
            )  # fmt: skip
    return plan


def _local_fingerprint(ranks: list[RankLayout]) -> str:
    """What a replica's ranks hold, blind to their numbering across the fleet."""
    renumbered = [RankLayout(j, lay.regions, lay.local_shapes, lay.dtype)
                  for j, lay in enumerate(ranks)]  # fmt: skip
    return layout_fingerprint(renumbered)


def _covered(groups: dict[Box, list], dst_box: Box, name: str, rank: int, problems: list):
    """``dst_box`` cut into cells, each with every sender holding it all; a cell nobody
    holds is added to ``problems`` (unless no sender has the tensor at all: reported once)."""
    candidates = [(box, g) for box, g in groups.items() if _intersect(box, dst_box)]
    if len(candidates) == 1 and _contains(candidates[0][0], dst_box):
        return [(dst_box, candidates[0][1])]
    out = []
    for cell in _cells(dst_box, [box for box, _ in candidates]):
        covering = [g for box, g in candidates if _contains(box, cell)]
        if not covering:
            if groups:
                problems.append(f"no sender holds {name} box {cell} (receiver {rank})")
            continue
        out.append((cell, covering[0] if len(covering) == 1 else [m for g in covering for m in g]))
    return out


class _Balance:
    """Elements assigned per sender, and the least-loaded holder of a replica group in
    O(log holders): one lazy heap per set of holder ranks (groups of the same ranks, listed in
    the same rank order, share it), re-keyed when a rank's load moved elsewhere. Groups must
    stay alive while it is used (their ids key a cache)."""

    def __init__(self):
        self.load: dict[int, int] = defaultdict(int)
        self._heaps: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        self._ranks: dict[int, tuple[int, ...]] = {}  # id(group) -> its holder ranks

    def take(self, group: list[tuple[int, Region]], numel: int) -> tuple[int, Region]:
        if len(group) == 1:
            rank, region = group[0]
        else:
            ranks = self._ranks.get(id(group))
            if ranks is None:
                ranks = self._ranks[id(group)] = tuple(r for r, _ in group)
            heap = self._heaps.get(ranks)
            if heap is None:
                heap = self._heaps[ranks] = [(self.load[r], r, i) for i, r in enumerate(ranks)]
                heapq.heapify(heap)
            while True:
                load, rank, i = heap[0]
                if load == self.load[rank]:
                    break
                heapq.heapreplace(heap, (self.load[rank], rank, i))
            region = group[i][1]
            heapq.heapreplace(heap, (load + numel, rank, i))
        self.load[rank] += numel
        return rank, region


def _bands(cell: Box, holders: int, min_band_numel: int) -> list[Box]:
    """A cell cut into bands of its first dimension: one per holder at most, none smaller
    than ``min_band_numel`` elements (one band when a single sender holds it)."""
    if holders == 1:
        return [cell]
    (lo, hi), rest = cell[0], cell[1:]
    parts = max(1, min(holders, hi - lo, numel(cell) // max(1, min_band_numel)))
    if parts == 1:
        return [cell]
    bounds = [lo + (hi - lo) * i // parts for i in range(parts + 1)]
    return [((a, b), *rest) for a, b in itertools.pairwise(bounds)]


def numel(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def _cells(box: Box, others: list[Box]) -> list[Box]:
    """Split ``box`` along every boundary of ``others`` inside it: each cell is covered wholly
    or not at all by each of the others."""
    cuts = []
    for dim, (lo, hi) in enumerate(box):
        points = {lo, hi} | {p for o in others for p in o[dim] if lo < p < hi}
        ordered = sorted(points)
        cuts.append(list(itertools.pairwise(ordered)))
    return [tuple(cell) for cell in itertools.product(*cuts)]


class PlanCache:
    """One plan per (senders, receivers) layout pair, recomputed only when a layout changes."""

    def __init__(self):
        self._plans: dict[str, Plan] = {}

    def get(
        self,
        senders: list[RankLayout],
        receivers: list[RankLayout],
        ignore: frozenset[str] = frozenset(),
    ) -> Plan:
        key = layout_fingerprint(senders) + layout_fingerprint(receivers) + repr(sorted(ignore))
        if key not in self._plans:
            self._plans[key] = plan_fleet(senders, receivers, ignore)
        return self._plans[key]


def layout_fingerprint(layouts: list[RankLayout]) -> str:
    digest = hashlib.sha256()
    for layout in sorted(layouts, key=lambda lay: lay.rank):
        digest.update(msgpack.packb([layout.rank, layout.replica, layout.dtype,
                                     sorted(layout.local_shapes.items())]))  # fmt: skip
        for r in layout.regions:
            p = r.piece
            digest.update(
                msgpack.packb([r.key, p.name, p.full_shape, p.box, p.offset, p.transposed])
            )
    return digest.hexdigest()

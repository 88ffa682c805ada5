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

import bisect
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
    # relay steps in chain order; each: seed-replica rank -> (rank passing on, rank receiving)
    hops: list[dict[int, tuple[int, int]]] = field(default_factory=list)
    # what users of the plan derive from it once (the exchange server's per-push items),
    # cached with it
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def relays(self) -> list[Relay]:
        """Every relay, in relay order along each chain (made on first use: a large fleet's
        plan has replicas x transfers of them, which planning at scale never needs)."""
        made = self.derived.get("relays")
        if made is None:
            made = self.derived["relays"] = [
                Relay(i, *hop[t.dst])
                for hop in self.hops
                for i, t in enumerate(self.transfers)
                if t.dst in hop
            ]
        return made

    def relay_next(self) -> dict[int, int]:
        """Receiving rank -> the rank it passes everything it receives to."""
        return {src: dst for hop in self.hops for src, dst in hop.values()}

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
    index: dict[str, _BoxIndex] = {}
    # (group, band, receiver rank, name, region) per transfer, in receiver order
    wanted: list[tuple[list, Box, int, str, Region]] = []
    for layout in sorted(receivers, key=lambda lay: lay.rank):
        for region in layout.regions:
            name, dst_box = region.piece.name, region.piece.box
            groups = holders.get(name, {})
            if len(groups) == 1 and _contains(box := next(iter(groups)), dst_box):
                covered = [(dst_box, groups[box])]  # the common case: one box (and replicas)
            else:
                if name not in index:
                    index[name] = _BoxIndex(groups)
                candidates = index[name].meeting(dst_box)
                covered = _covered(candidates, bool(groups), dst_box, name, layout.rank, problems)
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
            transfers[i] = Transfer(
                rank, dst, name, band, src.key, src.piece, region.key, region.piece
            )
        else:
            shared.append((-numel(band), i))
    shared.sort()
    for size, i in shared:
        group, band, dst, name, region = wanted[i]
        rank, src = balance.take(group, -size)
        transfers[i] = Transfer(rank, dst, name, band, src.key, src.piece, region.key, region.piece)
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
    known: dict = {}
    for replica in sorted(replicas):
        key = _local_fingerprint(replicas[replica], known)
        chains.setdefault(key, []).append(replicas[replica])
    seeds = [lay for chain in chains.values() for lay in chain[0]]
    plan = plan_transfers(senders, seeds, ignore, min_band_numel)
    plan.num_receivers = max(lay.rank for lay in receivers) + 1
    for chain in chains.values():
        for upstream, downstream in itertools.pairwise(chain):
            trio = zip(chain[0], upstream, downstream, strict=True)
            plan.hops.append({first.rank: (up.rank, down.rank) for first, up, down in trio})
    return plan


def _local_fingerprint(ranks: list[RankLayout], known: dict) -> str:
    """What a replica's ranks hold, blind to their numbering across the fleet. ``known``
    caches it per tuple of region lists: replicas built from the same lists hold the same."""
    key = tuple((id(lay.regions), id(lay.local_shapes), lay.dtype, id(lay.dtypes)) for lay in ranks)
    if key not in known:
        renumbered = [
            RankLayout(
                j,
                lay.regions,
                lay.local_shapes,
                lay.dtype,
                dtypes=lay.dtypes,
                fp8_blocks=lay.fp8_blocks,
            )
            for j, lay in enumerate(ranks)
        ]
        known[key] = (layout_fingerprint(renumbered), ranks)  # ranks keep the ids alive
    return known[key][0]


class _BoxIndex:
    """One tensor's sender boxes sorted by their first dim's start: the boxes meeting a box
    are found by bisection (a box starting before ``lo - longest`` cannot reach ``lo``)."""

    def __init__(self, groups: dict[Box, list]):
        entries = sorted(groups.items(), key=lambda item: item[0][0][0] if item[0] else 0)
        self.entries = entries
        self.starts = [box[0][0] if box else 0 for box, _ in entries]
        self.longest = max((box[0][1] - box[0][0] for box, _ in entries if box), default=0)

    def meeting(self, box: Box) -> list[tuple[Box, list]]:
        if not box:
            return [e for e in self.entries]
        (lo, hi) = box[0]
        first = bisect.bisect_right(self.starts, lo - self.longest)
        last = bisect.bisect_left(self.starts, hi)
        rest = box[1:]
        return [
            (b, g)
            for b, g in self.entries[first:last]
            if b[0][1] > lo
            and all(a0 < z1 and z0 < a1 for (a0, a1), (z0, z1) in zip(b[1:], rest, strict=True))
        ]


def _covered(
    candidates: list, any_sender: bool, dst_box: Box, name: str, rank: int, problems: list
):
    """``dst_box`` cut into cells, each with every sender holding it all; a cell nobody
    holds is added to ``problems`` (unless no sender has the tensor at all: reported once).
    ``candidates``: the (box, holders) meeting ``dst_box``.

    The cells are the grid every candidate's boundaries cut ``dst_box`` into; each candidate
    covers a block of consecutive grid intervals per dim, so the holders of every cell are
    found in time proportional to the cells each candidate covers."""
    if len(candidates) == 1 and _contains(candidates[0][0], dst_box):
        return [(dst_box, candidates[0][1])]
    (lo, hi), rest = dst_box[0], dst_box[1:]
    if all(_contains(box[1:], rest) for box, _ in candidates):  # cut along dim 0 alone
        spans = sorted((max(box[0][0], lo), min(box[0][1], hi), g) for box, g in candidates)
        if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)):  # and not overlapping
            out, at = [], lo
            for a, z, group in spans:
                if a > at and any_sender:
                    problems.append(
                        f"no sender holds {name} box {((at, a), *rest)} (receiver {rank})"
                    )
                out.append((((a, z), *rest), group))
                at = z
            if at < hi and any_sender:
                problems.append(f"no sender holds {name} box {((at, hi), *rest)} (receiver {rank})")
            return out
    points = []
    for dim, (lo, hi) in enumerate(dst_box):
        cut = {lo, hi} | {p for box, _ in candidates for p in box[dim] if lo < p < hi}
        points.append(sorted(cut))
    covering: dict[tuple[int, ...], list] = {}
    for box, group in candidates:
        spans = []
        for dim, (b0, b1) in enumerate(box):
            pts = points[dim]
            spans.append(
                range(
                    bisect.bisect_left(pts, max(b0, pts[0])),
                    bisect.bisect_left(pts, min(b1, pts[-1])),
                )
            )
        for index in itertools.product(*spans):
            covering.setdefault(index, []).append(group)
    out = []
    for index in itertools.product(*(range(len(pts) - 1) for pts in points)):
        cell = tuple((pts[i], pts[i + 1]) for pts, i in zip(points, index, strict=True))
        holders = covering.get(index)
        if not holders:
            if any_sender:
                problems.append(f"no sender holds {name} box {cell} (receiver {rank})")
            continue
        out.append((cell, holders[0] if len(holders) == 1 else [m for g in holders for m in g]))
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


def _contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


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
        digest.update(
            msgpack.packb(
                [
                    layout.rank,
                    layout.replica,
                    layout.dtype,
                    sorted(layout.local_shapes.items()),
                    sorted(layout.dtypes.items()),
                    sorted(layout.fp8_blocks.items()),
                ]
            )
        )
        for r in layout.regions:
            p = r.piece
            digest.update(
                msgpack.packb([r.key, p.name, p.full_shape, p.box, p.offset, p.transposed])
            )
    return digest.hexdigest()

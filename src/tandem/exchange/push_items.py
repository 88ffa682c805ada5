"""One push's items and records, derived from a plan (once per plan, dtype and transport: the
exchange server caches them with the plan): what each trainer rank sends where (`SendItem`),
what each receiving rank takes from where (`Record`), relays included, and the bytes each
replica needs; and afterwards, what each replica took in (`ReplicaPush`)."""

from __future__ import annotations

from collections import defaultdict

from tandem.dtypes import DTYPES
from tandem.exchange.delta import PAYLOAD_KEY
from tandem.exchange.items import DeltaBox, Record, SendItem
from tandem.exchange.layout import RankLayout
from tandem.exchange.plan import numel
from tandem.exchange.protocol import ReplicaPush
from tandem.layers.placement import LocalRegion


def replica_figures(
    replicas: dict[int, tuple[int, frozenset[int]]],
    ingress: dict[int, tuple[int, float]],
    failures: dict[int, str],
    ok: str = "committed",
) -> list[ReplicaPush]:
    """Per replica: the bytes it needs, what arrived at its ranks (counted there), what it
    passed on (what arrived at the replicas it relays to, counted there), its phases'
    seconds, and how it came out (``ok``, or "failed" with the reason from ``failures``).
    ``replicas``: replica -> (bytes needed, the replicas it relays to)."""
    arrived = {r: ingress.get(r, (0, 0.0))[0] for r in replicas}
    return [
        ReplicaPush(
            r,
            needed,
            arrived[r],
            sum(arrived[d] for d in feeds),
            ingress.get(r, (0, 0.0))[1],
            "failed" if r in failures else ok,
            failures.get(r),
        )
        for r, (needed, feeds) in sorted(replicas.items())
    ]


def push_items(
    plan,
    receivers: list[RankLayout],
    per_stream: bool,
    read_staging: bool,
    payloads: list[DeltaBox] | None = None,
):
    """Per sender rank: (bytes, `SendItem`s, (engine rank, `Record`)s, (item index, engine
    rank, `Record`)s of the boxes that reach other replicas by relay), and the bytes one copy of
    the fleet's distinct layouts needs (what the senders must send) and each replica needs.
    Every box travels in the dtype of the engine parameter it lands in; with ``payloads``
    (a delta push: per transfer, how its payload applies) as that payload's bytes, read
    from the sender's payloads (`delta.PAYLOAD_KEY`: each rank's back to back, in its items'
    order) and carried to the receiving ranks with their `DeltaBox`.

    Offsets count per (sender, receiver) stream with ``per_stream``, else per sender; both
    regions are mapped by their `Piece`. A relay (`Plan.relays`) is carried out by the
    transport: with ``read_staging`` the relayed-to rank reads the box where the sender
    staged it (one staging every replica on the host reads), else the rank holding it passes
    it on (``Record.forward`` / ``Record.via``, streams of their own)."""
    items: list[list[SendItem]] = [[] for _ in range(plan.num_senders)]
    records: list[list[tuple[int, Record]]] = [[] for _ in range(plan.num_senders)]
    relayed: list[list[tuple[int, int, Record]]] = [[] for _ in range(plan.num_senders)]
    offsets: dict[tuple[int, int], int] = defaultdict(int)
    forwards: dict[tuple[int, int], list[int]] = defaultdict(list)  # (transfer, rank) -> to
    if not read_staging:
        for relay in plan.relays:
            forwards[(relay.seed, relay.src)].append(relay.dst)
    seeds = []  # per transfer: (its sender, the item's index there)
    layouts = {lay.rank: lay for lay in receivers}
    payload_at = [0] * plan.num_senders  # where each sender's next payload starts
    for i, t in enumerate(plan.transfers):
        dtype = layouts[t.dst].dtype_of(t.dst_key)
        nbytes = t.numel * DTYPES[dtype].itemsize
        box_shape = tuple(b - a for a, b in t.box)
        key, src = t.src_key, t.src_piece.region(t.box)
        delta = None if payloads is None else payloads[i]
        if delta is not None:  # the payload's bytes travel, not the box
            nbytes, dtype, box_shape, key = delta.nbytes, "uint8", (delta.nbytes,), PAYLOAD_KEY
            src = LocalRegion(((payload_at[t.src], payload_at[t.src] + nbytes),))
            payload_at[t.src] += nbytes
        stream = (t.src, t.dst if per_stream else -1)
        offset = offsets[stream]
        dst_region = t.dst_piece.region(t.box)
        seeds.append((t.src, len(items[t.src])))
        items[t.src].append(
            SendItem(
                key,
                src,
                box_shape,
                offset,
                nbytes,
                t.dst,
                t.dst_key,
                dst_region,
                dtype,
                t.name,
                tuple(a for a, _ in t.box),
            )
        )
        records[t.src].append(
            (
                t.dst,
                Record(
                    t.src,
                    offset,
                    nbytes,
                    t.dst_key,
                    dst_region,
                    box_shape,
                    dtype,
                    forward=tuple(forwards[(i, t.dst)]),
                    delta=delta,
                ),
            )
        )
        offsets[stream] += nbytes
    for relay in plan.relays:
        sender, index = seeds[relay.seed]
        seed = records[sender][index][1]
        if read_staging:
            record = seed
        else:
            stream = (-1 - relay.src, relay.dst)  # a receiving rank's stream to another
            record = Record(
                seed.source,
                offsets[stream],
                seed.nbytes,
                seed.key,
                seed.region,
                seed.box_shape,
                seed.dtype,
                via=relay.src,
                forward=tuple(forwards[(relay.seed, relay.dst)]),
                delta=seed.delta,
            )
            offsets[stream] += seed.nbytes
        relayed[sender].append((index, relay.dst, record))
    sizes = [offsets[(i, -1)] for i in range(plan.num_senders)]
    by_replica: dict[int, int] = defaultdict(int)
    replica_of = {lay.rank: lay.replica for lay in receivers}
    for lay in receivers:
        by_replica[lay.replica] += sum(
            numel(r.piece.box) * DTYPES[lay.dtype_of(r.key)].itemsize for r in lay.regions
        )
    feeds: dict[int, set[int]] = defaultdict(set)  # replica -> the replicas it passes boxes
    for relay in [] if read_staging else plan.relays:
        feeds[replica_of[relay.src]].add(replica_of[relay.dst])
    fed = {replica_of[relay.dst] for relay in plan.relays}
    needed = sum(n for replica, n in by_replica.items() if replica not in fed)
    replicas = {r: (n, frozenset(feeds[r])) for r, n in by_replica.items()}
    return sizes, items, records, relayed, needed, replicas

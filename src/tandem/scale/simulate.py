"""A bucket-level schedule simulation of one push, and the lower bound it can never beat.

Each (sender, receiver) pair's bytes go in buckets. A GPU's egress on one link class is a
port: it sends one bucket at a time, choosing among its queues (one per destination, one per
relay it forwards) the bucket that can start first; a bucket holds the sender's egress and the
receiver's ingress of that class for ``bytes / bandwidth`` and lands ``latency`` later (writes
are pipelined, so latency delays what waits on a bucket, not the link). A sender casting to the
engine's dtype converts bucket after bucket at its conversion rate, ahead of sending. A relay
forwards each bucket as soon as it has landed. The bound is the busiest resource alone: its
bytes over its rate; every simulated schedule takes at least that long.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Flow:
    """All bytes sender ``src`` puts on the wire for receiver ``dst`` (plan ranks)."""

    src: int
    dst: int
    wire_bytes: int
    src_bytes: int  # what the sender reads for them (converted when the network converts)


@dataclass(frozen=True, slots=True)
class Network:
    sender_gpu: list[int]
    receiver_gpu: list[int]
    link: Callable[[int, int], str]  # (gpu, gpu) -> link class
    bandwidth: dict[str, float]  # bytes/s of one direction of one GPU's link, per class
    latency_s: float = 0.0
    convert_Bps: float | None = None  # senders cast at this rate (source bytes/s); None: no cast


@dataclass(slots=True)
class Simulation:
    seconds: float
    link_bytes: dict[tuple[int, str, str], int]  # (gpu, class, "out"|"in") -> bytes
    convert_bytes: dict[int, int]  # sender -> bytes converted
    buckets: int
    hops: int
    landed: dict[int, float] = field(default_factory=dict)  # receiver -> last bucket landed

    def bound(self, net: Network) -> tuple[float, str]:
        """(seconds, which resource) of the busiest resource alone."""
        loads = [
            (n / net.bandwidth[cls], f"gpu {gpu} {cls} {way}")
            for (gpu, cls, way), n in self.link_bytes.items()
        ]
        if net.convert_Bps:
            loads += [
                (n / net.convert_Bps, f"sender {sender} conversion")
                for sender, n in self.convert_bytes.items()
            ]
        return max(loads, key=lambda load: load[0], default=(0.0, "none"))  # first of ties


class _Port:
    __slots__ = ("gpu", "cls", "free", "queues", "waiting")

    def __init__(self, gpu: int, cls: str):
        self.gpu, self.cls, self.free = gpu, cls, 0.0
        self.queues: list[_Queue] = []
        self.waiting = False  # an event for it is in the heap


class _Queue:
    __slots__ = ("dst", "ingress", "items", "sender")

    def __init__(self, dst: int, ingress: tuple[int, str], sender: int | None):
        self.dst, self.ingress, self.sender = dst, ingress, sender
        self.items: deque = deque()  # (wire bytes, source bytes, ready time)


def simulate(
    flows: list[Flow], chain_next: dict[int, int], net: Network, bucket_bytes: int
) -> Simulation:
    """Every flow, then each receiver's bytes relayed along ``chain_next`` (receiver ->
    the receiver it forwards everything it gets to)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    ports: dict[tuple[int, str], _Port] = {}
    queues: dict[tuple[int, int, str], _Queue] = {}
    link_bytes: dict[tuple[int, str, str], int] = defaultdict(int)
    convert_bytes: dict[int, int] = defaultdict(int)
    ingress_free: dict[tuple[int, str], float] = defaultdict(float)
    received: dict[int, int] = defaultdict(int)
    buckets = 0

    def queue(src_gpu: int, dst: int, dst_gpu: int, sender: int | None) -> _Queue:
        cls = net.link(src_gpu, dst_gpu)
        port = ports.get((src_gpu, cls))
        if port is None:
            port = ports[(src_gpu, cls)] = _Port(src_gpu, cls)
        key = (src_gpu, dst, "relay" if sender is None else "send")
        q = queues.get(key)
        if q is None:
            q = queues[key] = _Queue(dst, (dst_gpu, cls), sender)
            port.queues.append(q)
        return q

    for f in sorted(flows, key=lambda f: (f.src, (f.dst - f.src) % max(1, len(net.receiver_gpu)))):
        sg, dg = net.sender_gpu[f.src], net.receiver_gpu[f.dst]
        q = queue(sg, f.dst, dg, f.src)
        n = max(1, -(-f.wire_bytes // bucket_bytes))
        for i in range(n):
            q.items.append((f.wire_bytes // n + (i < f.wire_bytes % n), f.src_bytes / n, 0.0))
        buckets += n
        cls = q.ingress[1]
        link_bytes[(sg, cls, "out")] += f.wire_bytes
        link_bytes[(dg, cls, "in")] += f.wire_bytes
        received[f.dst] += f.wire_bytes
        if net.convert_Bps:
            convert_bytes[f.src] += f.src_bytes
    for first in list(received):
        d = first
        while d in chain_next:
            n = chain_next[d]
            a, b = net.receiver_gpu[d], net.receiver_gpu[n]
            cls = net.link(a, b)
            link_bytes[(a, cls, "out")] += received[first]
            link_bytes[(b, cls, "in")] += received[first]
            queue(a, n, b, None)
            d = n

    convert_clock: dict[int, float] = defaultdict(float)
    heap = [(0.0, i, key) for i, key in enumerate(ports)]
    for port in ports.values():
        port.waiting = True
    heapq.heapify(heap)
    seq, hops, end_all = len(heap), 0, 0.0
    landed: dict[int, float] = {}
    while heap:
        now, _, key = heapq.heappop(heap)
        port = ports[key]
        port.waiting = False
        best, best_start = None, 0.0
        for q in port.queues:
            if not q.items:
                continue
            wire, src, ready = q.items[0]
            if q.sender is not None and net.convert_Bps:
                ready = convert_clock[q.sender] + src / net.convert_Bps
            start = max(now, port.free, ingress_free[q.ingress], ready)
            if best is None or start < best_start:
                best, best_start = q, start
        if best is None:
            continue
        wire, src, _ = best.items.popleft()
        if best.sender is not None and net.convert_Bps:
            convert_clock[best.sender] += src / net.convert_Bps
        sent = best_start + wire / net.bandwidth[port.cls]
        end = sent + net.latency_s  # writes are pipelined: latency holds no link
        port.free = ingress_free[best.ingress] = sent
        hops += 1
        end_all = max(end_all, end)
        landed[best.dst] = end
        seq += 1
        heapq.heappush(heap, (sent, seq, key))
        port.waiting = True
        nxt = chain_next.get(best.dst)
        if nxt is not None:
            a = net.receiver_gpu[best.dst]
            relay = queues[(a, nxt, "relay")]
            relay.items.append((wire, 0.0, end))
            rport = ports[(a, relay.ingress[1])]
            if not rport.waiting:
                seq += 1
                heapq.heappush(heap, (max(end, rport.free), seq, (a, relay.ingress[1])))
                rport.waiting = True
    return Simulation(end_all, dict(link_bytes), dict(convert_bytes), buckets, hops, landed)

"""`predict_sync`: the real plan of a push at scale, its bytes per link, its bound and its
predicted time (what `tandem plan` prints)."""

from __future__ import annotations

import math
import resource
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from tandem.exchange.plan import Plan, numel, plan_fleet
from tandem.scale.cluster import Cluster
from tandem.scale.layouts import (
    FleetSpec,
    TrainerSpec,
    canonical_shapes,
    fleet_layouts,
    trainer_layouts,
)
from tandem.scale.shapes import model_spec
from tandem.scale.simulate import Flow, Network, Simulation, simulate
from tandem.scale.wire import WIDTH, WireFormat


@dataclass(slots=True)
class SyncPrediction:
    model: str
    params: int
    trainer: dict
    fleet: dict
    engine_dtype: str
    cluster: dict
    bucket_bytes: int
    transfers: int
    relays: int
    buckets: int
    layout_seconds: float
    planner_seconds: float
    simulate_seconds: float
    peak_rss_mb: float
    trainer_egress_bytes: int
    replica_ingress_bytes: list[int]
    link_class_bytes: dict[str, int]
    busiest_links: list[dict]
    bound_seconds: float
    bound_link: str
    egress_bound_seconds: float
    ingress_bound_seconds: float
    predicted_seconds: float
    predicted_over_bound: float
    delta_density: float | None = None  # a delta push: the fraction of elements that changed
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def predict_sync(
    model: str,
    trainer: TrainerSpec,
    fleet: FleetSpec,
    engine_dtype: str = "bf16",
    cluster: Cluster | None = None,
    bucket_bytes: int = 16 << 20,
    delta_density: float | None = None,
) -> SyncPrediction:
    cluster = cluster or Cluster()
    wire = WireFormat(engine_dtype, delta_density)
    spec = model_spec(model)
    t0 = time.perf_counter()
    receivers = fleet_layouts(spec, fleet, wire.engine_dtype)
    shapes = canonical_shapes(receivers)
    senders = trainer_layouts(spec, trainer, shapes)
    t1 = time.perf_counter()
    plan = plan_fleet(senders, receivers)
    t2 = time.perf_counter()
    flows = plan_flows(plan, wire, WIDTH[trainer.dtype])
    sender_gpu, receiver_gpu = cluster.gpus(trainer.ranks, len(receivers))
    net = Network(
        sender_gpu,
        receiver_gpu,
        cluster.link,
        cluster.bandwidth,
        cluster.latency_us * 1e-6,
        cluster.convert_GBps * 1e9 if trainer.dtype != wire.engine_dtype else None,
    )
    sim = simulate(flows, plan.relay_next(), net, bucket_bytes)
    t3 = time.perf_counter()
    bound, where = sim.bound(net)
    replica_of = {g: r // fleet.ranks_per_replica for r, g in enumerate(receiver_gpu)}
    ingress = [0] * fleet.replicas
    for (gpu, _cls, way), n in sim.link_bytes.items():
        if way == "in":
            ingress[replica_of[gpu]] += n
    return SyncPrediction(
        model=model,
        params=sum(math.prod(s) for s in shapes.values()),
        trainer=asdict(trainer),
        fleet=asdict(fleet),
        engine_dtype=wire.engine_dtype,
        cluster=asdict(cluster),
        bucket_bytes=bucket_bytes,
        transfers=len(plan.transfers),
        relays=_relays(plan),
        buckets=sim.hops,
        layout_seconds=t1 - t0,
        planner_seconds=t2 - t1,
        simulate_seconds=t3 - t2,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        trainer_egress_bytes=sum(f.wire_bytes for f in flows),
        replica_ingress_bytes=ingress,
        link_class_bytes=_by_class(sim),
        busiest_links=_busiest(sim, net, cluster, sender_gpu, receiver_gpu),
        bound_seconds=bound,
        bound_link=where,
        egress_bound_seconds=_side_bound(sim, net, set(sender_gpu), "out"),
        ingress_bound_seconds=_side_bound(sim, net, set(receiver_gpu), "in"),
        predicted_seconds=sim.seconds,
        predicted_over_bound=sim.seconds / bound if bound else 1.0,
        delta_density=delta_density,
        notes=[] if delta_density is None else [DELTA_NOTE],
    )


DELTA_NOTE = (
    "delta: each box carries its smallest payload (dense, bitmap + values, or int32 indices + "
    "values) for the given fraction of changed elements; the bound and the simulation move "
    "those bytes. Encoding (a pass over each trainer rank's shard and its shadow) and the "
    "engine's apply and whole-box checks are not modeled"
)


def plan_flows(plan: Plan, wire: WireFormat, src_width: int) -> list[Flow]:
    """The plan's transfers summed per (sender, receiver)."""
    wire_bytes: dict[tuple[int, int], int] = defaultdict(int)
    src_bytes: dict[tuple[int, int], int] = defaultdict(int)
    for t in plan.transfers:
        key = (t.src, t.dst)
        wire_bytes[key] += wire.box_bytes(t.name, t.dst_piece.full_shape, t.box)
        src_bytes[key] += numel(t.box) * src_width
    return [Flow(s, d, n, src_bytes[(s, d)]) for (s, d), n in wire_bytes.items()]


def _relays(plan: Plan) -> int:
    """How many `Relay`s the plan stands for (without making them)."""
    into = Counter(t.dst for t in plan.transfers)
    return sum(into[first] for hop in plan.hops for first in hop)


def _by_class(sim: Simulation) -> dict[str, int]:
    """Bytes sent per link class (each counted once, at its sender)."""
    out: dict[str, int] = defaultdict(int)
    for (_gpu, cls, way), n in sim.link_bytes.items():
        if way == "out":
            out[cls] += n
    return dict(out)


def _busiest(sim: Simulation, net: Network, cluster: Cluster, senders, receivers, top: int = 5):
    trainer, fleet = set(senders), set(receivers)
    rows = []
    for (gpu, cls, way), n in sim.link_bytes.items():
        role = "+".join(r for r, s in (("trainer", trainer), ("engine", fleet)) if gpu in s)
        rows.append(
            {
                "link": f"{cluster.name(gpu)} ({role}) {cls} {way}",
                "bytes": n,
                "seconds": n / net.bandwidth[cls],
            }
        )
    rows.sort(key=lambda row: -row["seconds"])
    return rows[:top]


def _side_bound(sim: Simulation, net: Network, gpus: set[int], way: str) -> float:
    """The side's bytes per link class spread evenly over its GPUs: what a perfectly
    balanced plan of the same bytes would need."""
    per_class: dict[str, int] = defaultdict(int)
    for (gpu, cls, w), n in sim.link_bytes.items():
        if w == way and gpu in gpus:
            per_class[cls] += n
    return max((n / (len(gpus) * net.bandwidth[c]) for c, n in per_class.items()), default=0.0)


def summary(p: SyncPrediction) -> str:
    gb = 1e9
    lines = [
        f"{p.model}: {p.params / 1e9:.1f}B parameters, {p.trainer['kind']} trainer of "
        f"{p.trainer['ranks']} ranks ({p.trainer['dtype']}) -> {p.fleet['replicas']} replicas x "
        f"tp {p.fleet['tp']} pp {p.fleet['pp']} ({p.engine_dtype})"
        + ("" if p.delta_density is None else f", delta at density {p.delta_density:g}"),
        f"plan: {p.transfers} transfers, {p.relays} relays; planner {p.planner_seconds:.2f} s "
        f"(layouts {p.layout_seconds:.2f} s), peak RSS {p.peak_rss_mb:.0f} MB",
        f"trainer egress {p.trainer_egress_bytes / gb:.1f} GB; replica ingress "
        f"{max(p.replica_ingress_bytes) / gb:.1f} GB (largest)",
        "bytes per link class: "
        + ", ".join(f"{c} {n / gb:.1f} GB" for c, n in sorted(p.link_class_bytes.items())),
        "busiest links:",
        *(
            f"  {row['link']}: {row['bytes'] / gb:.2f} GB, {row['seconds']:.3f} s"
            for row in p.busiest_links
        ),
        f"bound {p.bound_seconds:.3f} s ({p.bound_link}); balanced egress "
        f"{p.egress_bound_seconds:.3f} s, ingress {p.ingress_bound_seconds:.3f} s",
        f"predicted {p.predicted_seconds:.3f} s = {p.predicted_over_bound:.3f}x the bound "
        f"({p.buckets} bucket hops of <= {p.bucket_bytes >> 20} MiB)",
    ]
    return "\n".join(lines)

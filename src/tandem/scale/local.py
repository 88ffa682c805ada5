"""This machine as a one-node cluster: the same schedule simulation (`tandem.scale.simulate`)
predicts the pushes `tandem bench sync` and `tandem bench fleet` measure, from link speeds
measured in the same run.

A process is a "GPU" of its own; its links are what its core does to bytes: a copy and a
CRC32, each measured on one thread and on every core at once (with ``active`` processes at
it, each gets ``min(one x its threads, all / active)``: the memory bus and the cores are
shared; ISA-L's CRC32 runs on one thread). Loopback streams (gloo, Mooncake over TCP) are
the node's CPU moving bytes through the kernel: one resource every stream and relay of the
phase shares, at the rate the raw baseline of the same streams reached (``stream_Bps``:
its bytes over its time), each byte's CRC32 on both ends adding to it. Work that shares a
core is serial: a link that copies and checksums each byte runs at 1 / (1/copy + 1/crc).

A push runs in phases, each waiting for the last (the exchange server's order), each one
simulated: the trainers' delivery, then what the engine's ranks do (receive, verify, commit).
What each push kind does in each phase:

- shm staged: trainers CRC+copy into their staging (a checked copy: each chunk checksummed as
  read, then copied from cache, measured as such); ranks CRC it (verify); ranks copy it into
  their parameters and CRC them there (commit).
- shm in place: trainers CRC+copy into the live parameters; ranks CRC them (verify).
- dist in place: trainers CRC+send, ranks receive+CRC, one stream per (trainer, rank), relays
  forwarding as boxes land; staged adds the commit (copy + CRC).
- mooncake: trainers CRC every box and copy into registered staging those they cannot offer
  in place (``staged``: bytes per trainer rank, as the senders counted them); ranks read
  (one-sided), CRC what landed, copy it into their parameters and CRC them; in place, read
  into the parameters and CRC them there (the copy into place of boxes strided in the engine
  is not modelled).

Unverified pushes drop every CRC. No constant is fitted: a push far slower than predicted
spends time that no link explains.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.scale.simulate import Flow, Network, simulate

KINDS = ("shm", "shm_in_place", "dist", "dist_in_place", "mooncake", "mooncake_in_place")


@dataclass(frozen=True, slots=True)
class LocalRates:
    copy_one_Bps: float  # one thread copying
    copy_all_Bps: float  # every core copying at once, together
    crc_one_Bps: float
    crc_all_Bps: float
    cores: int
    stream_Bps: float | None = None  # the node's loopback streams together (dist, mooncake)
    # a sender's write: each chunk checksummed as read, then copied from cache (`checked_copy`)
    checked_copy_one_Bps: float | None = None
    checked_copy_all_Bps: float | None = None

    @classmethod
    def measured(cls, cpu: dict, stream_Bps: float | None = None) -> LocalRates:
        """From `tandem.bench.sync_baselines.cpu_rates`'s figures."""
        return cls(
            cpu["copy_one_Bps"],
            cpu["copy_all_Bps"],
            cpu["crc_one_Bps"],
            cpu["crc_all_Bps"],
            cpu["cores"],
            stream_Bps,
            cpu.get("checked_copy_one_Bps"),
            cpu.get("checked_copy_all_Bps"),
        )

    def copy(self, active: int, threads: int = 1) -> float:
        """Seconds per byte copied by each of ``active`` processes copying at once."""
        return 1 / min(self.copy_one_Bps * threads, self.copy_all_Bps / active)

    def crc(self, active: int) -> float:
        return 1 / min(self.crc_one_Bps, self.crc_all_Bps / active)

    def checked_copy(self, active: int) -> float:
        if self.checked_copy_one_Bps is None or self.checked_copy_all_Bps is None:
            return self.copy(active) + self.crc(active)
        return 1 / min(self.checked_copy_one_Bps, self.checked_copy_all_Bps / active)


def stream_rate(streams: list[list[int]], seconds: float) -> float:
    """The node's loopback rate a raw baseline of ``streams`` reached in ``seconds``."""
    return sum(map(sum, streams)) / seconds


def predict_push(
    kind: str,
    streams: list[list[int]],
    rates: LocalRates,
    verify: bool = True,
    replicas: int = 1,
    engine_threads: int = 1,
    staged: list[int | None] | None = None,
) -> dict:
    """Predicted seconds of one push of ``kind`` (`KINDS`) moving ``streams[s][d]`` bytes from
    trainer rank s (one thread each) to engine rank d of each of ``replicas`` replicas (each
    rank ``engine_threads`` threads): {"seconds", "phases"}."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    ranks = len(streams[0])
    per_rank = [sum(row[d] for row in streams) for d in range(ranks)] * replicas
    per_sender = [sum(row) for row in streams]
    phases: dict[str, float] = {}
    if kind in ("shm", "shm_in_place"):
        phases["deliver"] = _cpu_seconds(per_sender, per_sender, rates, verify)
    if kind.startswith("mooncake"):  # every box checksummed, the staged ones copied too
        copied = [
            n if st is None else st
            for n, st in zip(per_sender, staged or [None] * len(per_sender), strict=True)
        ]
        phases["deliver"] = _cpu_seconds(per_sender, copied, rates, verify)
        phases["receive"] = _stream(streams, replicas, rates, relays=False, crc=False)
    if kind.startswith("dist"):
        phases["deliver"] = _stream(streams, replicas, rates, relays=True, crc=verify)
    if verify and kind.startswith(("shm", "mooncake")):
        phases["verify"] = _cpu_pass(per_rank, rates, engine_threads, copy=False, crc=True)
    if kind in ("shm", "dist", "mooncake"):
        phases["commit"] = _cpu_pass(per_rank, rates, engine_threads, copy=True, crc=verify)
    return {"seconds": sum(phases.values()), "phases": phases}


def _cpu_pass(nbytes: list[int], rates: LocalRates, threads: int, copy: bool, crc: bool) -> float:
    """Every process working through its bytes at once (copying and/or checksumming each)."""
    active = sum(1 for n in nbytes if n)
    per_byte = (rates.copy(active, threads) if copy else 0.0) + (rates.crc(active) if crc else 0.0)
    if not per_byte or not active:
        return 0.0
    flows = [Flow(p, p, n, n) for p, n in enumerate(nbytes) if n]
    net = Network(
        list(range(len(nbytes))),
        list(range(len(nbytes), 2 * len(nbytes))),
        lambda a, b: "cpu",
        {"cpu": 1 / per_byte},
    )
    return simulate(flows, {}, net, 1 << 60).seconds


def _cpu_seconds(checked: list[int], copied: list[int], rates: LocalRates, crc: bool) -> float:
    """Trainer processes at once (one thread each), each writing its ``copied`` bytes (a
    checked copy: `checked_copy`; a plain copy unverified) and checksumming the rest of its
    ``checked`` bytes where they are: the slowest one's time."""
    active = sum(1 for n in checked if n)
    write = rates.checked_copy(active) if crc else rates.copy(active)
    return max(
        (
            (n - c) * (rates.crc(active) if crc else 0.0) + c * write
            for n, c in zip(checked, copied, strict=True)
        ),
        default=0.0,
    )


def _stream(streams, replicas: int, rates: LocalRates, relays: bool, crc: bool) -> float:
    """Trainers -> the first replica's ranks, then (``relays``) replica k -> k + 1 rank by
    rank as boxes land, or (no relays) every replica reads from the trainers: every byte of
    every hop through the node's one loopback resource, CRC32s (sender's, receiver's) with
    it."""
    if rates.stream_Bps is None:
        raise ValueError("a stream push needs rates.stream_Bps (its raw baseline)")
    senders, ranks = len(streams), len(streams[0])
    per_byte = 1 / rates.stream_Bps + (2 / rates.crc_all_Bps if crc else 0.0)
    if relays:
        flows = [Flow(s, d, n, n) for s, row in enumerate(streams) for d, n in enumerate(row) if n]
        chain = {
            r * ranks + d: (r + 1) * ranks + d for r in range(replicas - 1) for d in range(ranks)
        }
    else:
        flows = [
            Flow(s, r * ranks + d, n, n)
            for r in range(replicas)
            for s, row in enumerate(streams)
            for d, n in enumerate(row)
            if n
        ]
        chain = {}
    node = Network(
        [0] * senders, [0] * (ranks * replicas), lambda a, b: "loopback", {"loopback": 1 / per_byte}
    )
    return simulate(flows, chain, node, 1 << 60).seconds

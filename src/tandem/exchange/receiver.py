"""The engine side of a push: check what arrived, then write it into the live parameters.

Receivers write into views of the existing parameters (``data_ptr`` never changes) and check
every record before writing any: a bad checksum or an unknown tensor rejects the whole update and
leaves the old weights serving.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from tandem.exchange.transports.shm import ShmSegment

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightSyncError(RuntimeError):
    """A push was rejected or broke; says whether the old weights are still serving."""


@dataclass(frozen=True, slots=True)
class Record:
    """One box for this rank: ``nbytes`` at ``offset`` of staged segment number ``segment``,
    written at ``slices`` of the local tensor ``key`` (transposed there when the engine stores
    it transposed)."""

    segment: int
    offset: int
    nbytes: int
    key: str
    slices: tuple[tuple[int, int], ...]
    box_shape: tuple[int, ...]
    transposed: bool
    crc: int | None  # zlib.crc32 of the bytes as sent; None: not verified

    def to_wire(self) -> list:
        return [self.segment, self.offset, self.nbytes, self.key, self.slices, self.box_shape,
                self.transposed, self.crc]  # fmt: skip

    @classmethod
    def from_wire(cls, w: list) -> Record:
        segment, offset, nbytes, key, slices, box_shape, transposed, crc = w
        slices = tuple(map(tuple, slices))
        return cls(segment, offset, nbytes, key, slices, tuple(box_shape), transposed, crc)


def verify_records(model: nn.Module, segments: list[ShmSegment], dtype: str, records: list[Record]):
    """Every problem with this rank's records (empty: all good). Nothing is written."""
    params = dict(model.named_parameters())
    torch_dtype = _DTYPES.get(dtype)
    problems = []
    for r in records:
        param = params.get(r.key)
        if param is None:
            problems.append(f"unknown parameter {r.key}")
            continue
        if param.dtype != torch_dtype:
            problems.append(f"{r.key}: sent as {dtype}, engine holds {param.dtype}")
        region = param[tuple(slice(a, b) for a, b in r.slices)]
        expected = r.box_shape[::-1] if r.transposed else r.box_shape
        if tuple(region.shape) != tuple(expected):
            problems.append(f"{r.key}{list(r.slices)}: box {r.box_shape} does not fit")
        if not 0 <= r.segment < len(segments):
            problems.append(f"{r.key}: no staged segment {r.segment}")
        elif r.crc is not None and _crc(segments[r.segment], r) != r.crc:
            problems.append(f"checksum mismatch for {r.key}{list(r.slices)}")
    return problems


def _crc(segment: ShmSegment, r: Record) -> int:
    return zlib.crc32(segment.view(r.offset, r.nbytes))


def write_records(
    model: nn.Module, segments: list[ShmSegment], dtype: str, records: list[Record]
) -> int:
    """Copy every record into its parameter, in place. Returns the bytes written."""
    params = dict(model.named_parameters())
    torch_dtype = _DTYPES[dtype]
    with torch.no_grad():
        for r in records:
            src = segments[r.segment].tensor(r.offset, r.nbytes, torch_dtype).view(r.box_shape)
            dst = params[r.key][tuple(slice(a, b) for a, b in r.slices)]
            dst.copy_(src.t() if r.transposed else src)
    return sum(r.nbytes for r in records)


def handle_apply(
    model: nn.Module, rank: int, phase: str, segments: list, dtype: str, wire_records: list
) -> tuple[str | None, int]:
    """One phase of a push on one rank: (error or None, bytes written). ``segments`` lists the
    staged shared-memory segments as (path, size)."""
    records = [Record.from_wire(w) for w in wire_records]
    needed = sorted({r.segment for r in records})
    mapped: dict[int, ShmSegment] = {}
    try:
        for i in needed:
            path, size = segments[i]
            mapped[i] = ShmSegment.open(path, size)
    except (OSError, ValueError, IndexError) as exc:
        for seg in mapped.values():
            seg.close()
        return f"rank {rank}: cannot map staged segment ({exc})", 0
    by_index = [mapped.get(i) for i in range(len(segments))]
    try:
        if phase == "verify":
            problems = verify_records(model, by_index, dtype, records)
            return (f"rank {rank}: " + "; ".join(problems)) if problems else None, 0
        if phase == "commit":
            return None, write_records(model, by_index, dtype, records)
        return f"rank {rank}: unknown phase {phase!r}", 0
    finally:
        for seg in mapped.values():
            seg.close()

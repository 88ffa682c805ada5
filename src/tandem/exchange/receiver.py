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
    """One box for this rank: bytes at ``offset`` of the segment, written at ``slices`` of the
    local tensor ``key`` (transposed there when the engine stores it transposed)."""

    offset: int
    nbytes: int
    key: str
    slices: tuple[tuple[int, int], ...]
    box_shape: tuple[int, ...]
    transposed: bool
    crc: int | None  # zlib.crc32 of the bytes as sent; None: not verified

    def to_wire(self) -> list:
        return [self.offset, self.nbytes, self.key, self.slices, self.box_shape, self.transposed,
                self.crc]  # fmt: skip

    @classmethod
    def from_wire(cls, w: list) -> Record:
        offset, nbytes, key, slices, box_shape, transposed, crc = w
        return cls(
            offset, nbytes, key, tuple(map(tuple, slices)), tuple(box_shape), transposed, crc
        )


def verify_records(model: nn.Module, segment: ShmSegment, dtype: str, records: list[Record]):
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
        if r.crc is not None and zlib.crc32(segment.view(r.offset, r.nbytes)) != r.crc:
            problems.append(f"checksum mismatch for {r.key}{list(r.slices)}")
    return problems


def write_records(model: nn.Module, segment: ShmSegment, dtype: str, records: list[Record]) -> int:
    """Copy every record into its parameter, in place. Returns the bytes written."""
    params = dict(model.named_parameters())
    torch_dtype = _DTYPES[dtype]
    with torch.no_grad():
        for r in records:
            src = segment.tensor(r.offset, r.nbytes, torch_dtype).view(r.box_shape)
            dst = params[r.key][tuple(slice(a, b) for a, b in r.slices)]
            dst.copy_(src.t() if r.transposed else src)
    return sum(r.nbytes for r in records)


def handle_apply(model: nn.Module, rank: int, phase: str, segment_path: str, size: int,
                 dtype: str, wire_records: list) -> tuple[str | None, int]:  # fmt: skip
    """One phase of a push on one rank: (error or None, bytes written)."""
    records = [Record.from_wire(w) for w in wire_records]
    try:
        segment = ShmSegment.open(segment_path, size)
    except (OSError, ValueError) as exc:
        return f"rank {rank}: cannot map {segment_path} ({exc})", 0
    try:
        if phase == "verify":
            problems = verify_records(model, segment, dtype, records)
            return (f"rank {rank}: " + "; ".join(problems)) if problems else None, 0
        if phase == "commit":
            return None, write_records(model, segment, dtype, records)
        return f"rank {rank}: unknown phase {phase!r}", 0
    finally:
        segment.close()

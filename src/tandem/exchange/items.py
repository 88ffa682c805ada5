"""The two halves of one planned box: what a trainer rank sends (`SendItem`) and what an engine
rank receives (`Record`). Named fields in memory, msgpack lists on the wire (no pickle)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.layers.placement import LocalRegion


@dataclass(frozen=True, slots=True)
class SendItem:
    """One box a trainer rank sends: read at ``src`` of its local tensor ``key``; ``nbytes`` in
    the engine's dtype at ``offset`` of its staging memory (per engine rank: of its stream to
    ``dst``, for dist); lands at ``dst_region`` of engine rank ``dst``'s parameter ``dst_key``."""

    key: str
    src: LocalRegion
    box_shape: tuple[int, ...]
    offset: int
    nbytes: int
    dst: int
    dst_key: str
    dst_region: LocalRegion

    def to_wire(self) -> list:
        return [self.key, self.src.to_wire(), list(self.box_shape), self.offset, self.nbytes,
                self.dst, self.dst_key, self.dst_region.to_wire()]  # fmt: skip

    @classmethod
    def from_wire(cls, w: list) -> SendItem:
        key, src, box_shape, offset, nbytes, dst, dst_key, dst_region = w
        return cls(key, LocalRegion.from_wire(src), tuple(box_shape), offset, nbytes, dst,
                   dst_key, LocalRegion.from_wire(dst_region))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Record:
    """One box for an engine rank, from trainer rank ``source``: ``nbytes`` at ``offset`` of
    what that rank staged (or of its stream, for dist), landing at ``region`` of the local
    parameter ``key``. ``crc``: the sender's CRC32 of the box as it read it from its tensor
    (`tandem.exchange.checksum.source_crc32`); None when the push is unverified."""

    source: int
    offset: int
    nbytes: int
    key: str
    region: LocalRegion
    box_shape: tuple[int, ...]
    crc: int | None = None

    @property
    def where(self) -> str:
        return f"{self.key}{[list(s) for s in self.region.slices]}"

    def with_crc(self, crc: int | None) -> Record:
        return replace(self, crc=crc)

    def to_wire(self) -> list:
        return [self.source, self.offset, self.nbytes, self.key, self.region.to_wire(),
                list(self.box_shape), self.crc]  # fmt: skip

    @classmethod
    def from_wire(cls, w: list) -> Record:
        source, offset, nbytes, key, region, box_shape, crc = w
        return cls(source, offset, nbytes, key, LocalRegion.from_wire(region), tuple(box_shape),
                   crc)  # fmt: skip

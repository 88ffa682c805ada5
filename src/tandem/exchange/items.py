"""The two halves of one planned box: what a trainer rank sends (`SendItem`) and what an engine
rank receives (`Record`); plain typed data, sent inside the exchange's and the engine's
messages (`tandem.wire.Codec`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.layers.placement import LocalRegion

ENCODINGS = ("dense", "bitmap", "indices")  # of a delta push's boxes (`tandem.exchange.delta`)


@dataclass(frozen=True, slots=True)
class SendItem:
    """One box a trainer rank sends: read at ``src`` of its local tensor ``key``; ``nbytes`` in
    ``dtype`` (the engine parameter's) at ``offset`` of its staging memory (per engine rank: of
    its stream to ``dst``, for dist); lands at ``dst_region`` of engine rank ``dst``'s
    parameter ``dst_key``. ``name`` / ``origin``: the canonical tensor and the box's first
    element in it (a float box sent into a block-FP8 weight is quantized with the scales of
    the blocks it lies in: `tandem.exchange.quantize`)."""

    key: str
    src: LocalRegion
    box_shape: tuple[int, ...]
    offset: int
    nbytes: int
    dst: int
    dst_key: str
    dst_region: LocalRegion
    dtype: str
    name: str
    origin: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DeltaBox:
    """How the payload of one box of a delta push applies (`tandem.exchange.delta`): its
    ``encoding`` (`ENCODINGS`), the number of elements that ``changed``, the payload's size in
    bytes, and the CRC32 of the trainer's whole new box in the engine dtype (None:
    unverified)."""

    encoding: str
    changed: int
    nbytes: int
    crc: int | None

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")


@dataclass(frozen=True, slots=True)
class Record:
    """One box for an engine rank, from trainer rank ``source``: ``nbytes`` at ``offset`` of
    what that rank staged (or of its stream, for dist), landing at ``region`` of the local
    parameter ``key``. ``crc``: the sender's CRC32 of the box as it read it from its tensor
    (`tandem.exchange.checksum.source_crc32`; a delta push: of the payload); None when the
    push is unverified.

    In a fleet a box reaches most replicas by relay: ``via`` is the receiving rank it comes
    from (-1: from trainer rank ``source`` itself), ``forward`` the receiving ranks this rank
    passes it on to once it landed (transports that forward; `Plan.relays`)."""

    source: int
    offset: int
    nbytes: int
    key: str
    region: LocalRegion
    box_shape: tuple[int, ...]
    dtype: str  # the parameter's, which the box arrives in
    crc: int | None = None
    via: int = -1
    forward: tuple[int, ...] = ()
    # a delta push: the record carries the box's payload (``dtype`` uint8, ``box_shape``
    # its bytes), which applies to the box at ``region`` as this says
    delta: DeltaBox | None = None

    @property
    def where(self) -> str:
        return f"{self.key}{[list(s) for s in self.region.slices]}"

    def with_crc(self, crc: int | None) -> Record:
        return replace(self, crc=crc)

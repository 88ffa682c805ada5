"""The engine side of a push: check what arrived, then write it into the live parameters.

Receivers write into views of the existing parameters (``data_ptr`` never changes) and check
every record before writing any: a bad checksum or an unknown tensor rejects the whole update and
leaves the old weights serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import crc32, tensor_crc32
from tandem.exchange.transports import dist as p2p
from tandem.exchange.transports.shm import MappedMemory


class WeightSyncError(RuntimeError):
    """A push was rejected or broke; says whether the old weights are still serving."""


@dataclass(frozen=True, slots=True)
class Record:
    """One box for this rank, from trainer rank ``source``: ``nbytes`` at ``offset`` of what
    that rank staged (or sends, for dist), written at ``slices`` of the local tensor ``key``
    (transposed there when the engine stores it transposed)."""

    source: int
    offset: int
    nbytes: int
    key: str
    slices: tuple[tuple[int, int], ...]
    box_shape: tuple[int, ...]
    transposed: bool
    crc: int | None  # CRC32 of the bytes as sent (`tandem.exchange.checksum`); None: unverified

    def to_wire(self) -> list:
        return [self.source, self.offset, self.nbytes, self.key, self.slices, self.box_shape,
                self.transposed, self.crc]  # fmt: skip

    @classmethod
    def from_wire(cls, w: list) -> Record:
        source, offset, nbytes, key, slices, box_shape, transposed, crc = w
        slices = tuple(map(tuple, slices))
        return cls(source, offset, nbytes, key, slices, tuple(box_shape), transposed, crc)


class TensorStaging:
    """Received bytes held in engine memory (the dist transport's staged mode), read like a
    trainer's shared staging memory."""

    def __init__(self, data: torch.Tensor):
        self.data = data  # uint8

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.data[offset : offset + nbytes].view(dtype)

    def view(self, offset: int, nbytes: int):
        return self.data[offset : offset + nbytes].numpy().data

    def close(self) -> None:
        pass


def verify_records(model: nn.Module, segments: list, dtype: str, records: list[Record]):
    """Every problem with this rank's records (empty: all good). Nothing is written.
    ``segments``: the staged bytes per record source (None where only CRCs are checked)."""
    params = dict(model.named_parameters())
    torch_dtype = DTYPES.get(dtype)
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
        if not 0 <= r.source < len(segments):
            problems.append(f"{r.key}: no staged source {r.source}")
        elif r.crc is not None and segments[r.source] is not None:
            if _crc(segments[r.source], r) != r.crc:
                problems.append(f"checksum mismatch for {r.key}{list(r.slices)}")
    return problems


def _crc(segment, r: Record) -> int:
    return crc32(segment.view(r.offset, r.nbytes))


def write_records(model: nn.Module, segments: list, dtype: str, records: list[Record]) -> int:
    """Copy every record into its parameter, in place. Returns the bytes written."""
    params = dict(model.named_parameters())
    torch_dtype = DTYPES[dtype]
    with torch.no_grad():
        for r in records:
            src = segments[r.source].tensor(r.offset, r.nbytes, torch_dtype).view(r.box_shape)
            _place(params[r.key], r, src)
    return sum(r.nbytes for r in records)


def _place(param: torch.Tensor, r: Record, box: torch.Tensor) -> None:
    dst = param[tuple(slice(a, b) for a, b in r.slices)]
    dst.copy_(box.t() if r.transposed else box)


class RankReceiver:
    """One engine rank's side of pushes. Phases, each answered with (error or None, bytes):

    - ``receive`` (dist transport): join the push's group, take every bucket from each trainer
      rank — into engine-side staging (mode ``staged``) or straight into the parameters
      (mode ``in_place``: no extra memory, but a broken push leaves them torn);
    - ``verify``: names, shapes, dtypes, and CRC32s against what the trainers sent;
    - ``commit``: write the staged boxes into the live parameters.
    """

    def __init__(self, model: nn.Module, rank: int, device: torch.device):
        self.model = model
        self.rank = rank
        self.device = device
        self._received: dict[int, tuple[list, list[list[int]]]] = {}  # version -> staging, crcs
        self._staging: torch.Tensor | None = None  # dist staged: reused by every push
        self._shared: dict[tuple, MappedMemory] = {}  # shm staged: trainers' staging, mapped

    def handle(self, phase: str, update: dict, wire_records: list) -> tuple[str | None, int]:
        records = [Record.from_wire(w) for w in wire_records]
        try:
            if update["transport"] == "shm" and update["mode"] == "in_place":
                return self._written_in_place(phase, update, records)
            if update["transport"] in ("shm", "cuda_ipc"):
                return self._from_staged(phase, update, records)
            return self._dist(phase, update, records)
        except Exception as exc:  # answered to the engine, which decides; never kills the rank
            self._received.pop(update["version"], None)
            self._shared = {}
            if update["transport"] == "dist" and "group" in update:
                p2p.abandon(p2p.GroupInfo.from_wire(update["group"]))
            return f"rank {self.rank}: {type(exc).__name__}: {exc}", 0

    def _written_in_place(self, phase: str, update: dict, records: list[Record]):
        """shm in_place: the trainer ranks wrote straight into this rank's parameters (its
        `ParamArena`) while the engine was paused; check what is there now."""
        if phase != "verify":
            return None, 0  # nothing to commit: the boxes are already in place
        problems = verify_records(self.model, [None] * update["trainers"], update["dtype"], records)
        if not problems:
            params = dict(self.model.named_parameters())
            for r in records:
                region = params[r.key][tuple(slice(a, b) for a, b in r.slices)]
                region = region.t() if r.transposed else region
                if r.crc is not None and tensor_crc32(region) != r.crc:
                    problems.append(f"checksum mismatch for {r.key}{list(r.slices)}")
        return (f"rank {self.rank}: " + "; ".join(problems)) if problems else None, 0

    def _from_staged(self, phase: str, update: dict, records: list[Record]):
        """shm / cuda_ipc: the trainer ranks staged everything; map what this rank reads.
        A trainer rank's shared staging memory is mapped once and kept while its pushes keep
        naming it (a mapping of another push's buffer is dropped, freeing it once its trainer
        is gone)."""
        needed = sorted({r.source for r in records})
        segments: list = [None] * len(update["segments"])
        if update["transport"] == "shm":
            shared = {}
            for i in needed:
                key = tuple(update["segments"][i][:3])
                shared[key] = self._shared.get(key) or MappedMemory(update["segments"][i],
                                                                    "staging memory")  # fmt: skip
                segments[i] = shared[key]
            self._shared = shared
            return self._check_or_write(phase, update["dtype"], segments, records)
        from tandem.exchange.transports.cuda_ipc import CudaStaging

        try:
            for i in needed:
                segments[i] = CudaStaging(update["segments"][i])
            return self._check_or_write(phase, update["dtype"], segments, records)
        finally:
            for seg in segments:
                if seg is not None:
                    seg.close()

    def _dist(self, phase: str, update: dict, records: list[Record]):
        version, dtype = update["version"], update["dtype"]
        if phase == "receive":
            self._received[version] = self._receive(update, records)
            return None, sum(r.nbytes for r in records)
        staging, crcs = self._received[version]
        if phase == "verify":
            problems = verify_records(self.model, [None] * len(staging), dtype, records)
            received = {src: iter(c) for src, c in enumerate(crcs)}
            for r in records:  # records from one source come in the order they were sent
                got = next(received[r.source], None)
                if r.crc is not None and got != r.crc:
                    problems.append(f"checksum mismatch for {r.key}{list(r.slices)}")
            if problems:
                self._received.pop(version, None)
                return f"rank {self.rank}: " + "; ".join(problems), 0
            return None, 0
        del self._received[version]
        if update["mode"] == "in_place":
            return None, 0  # already written while receiving
        return self._check_or_write("commit", dtype, staging, records)

    def _receive(self, update: dict, records: list[Record]):
        """Take every source's boxes, sources in `stream_order`: into this rank's staging buffer
        (kept for later pushes, so they touch no new memory), or straight into the live
        parameters (in_place). Returns (staged sources, CRC32 per source and record)."""
        info = p2p.GroupInfo.from_wire(update["group"])
        group = p2p.join(info, update["trainers"] + self.rank)
        params = dict(self.model.named_parameters())
        by_src = [[r for r in records if r.source == src] for src in range(update["trainers"])]
        staged = update["mode"] == "staged"
        if staged:
            total = sum(r.nbytes for r in records)
            if self._staging is None or self._staging.numel() < total:
                self._staging = None
                self._staging = torch.zeros(total, dtype=torch.uint8, device=self.device)
        staging: list = [None] * update["trainers"]
        crcs: list[list[int | None]] = [[] for _ in by_src]
        start = 0
        engine_ranks = info.world - update["trainers"]
        order = p2p.stream_order(self.rank, range(update["trainers"]), update["trainers"],
                                 engine_ranks, sending=False)  # fmt: skip
        for src in order:  # the order every rank agrees on: no cyclic waits
            mine = by_src[src]
            if not mine:
                continue
            sizes = [r.nbytes for r in mine]
            rows = [r.box_shape[0] if r.box_shape else 1 for r in mine]
            if staged:
                buf = self._staging[start : start + sum(sizes)]
                start += sum(sizes)
                staging[src] = TensorStaging(buf)
                into = {"staging": buf}
            else:
                targets = []
                for r in mine:
                    region = params[r.key][tuple(slice(a, b) for a, b in r.slices)]
                    targets.append(region.t() if r.transposed else region)
                into = {"targets": targets}
            with torch.no_grad():
                crcs[src] = p2p.recv_boxes(group, src, sizes, rows, update["bucket_bytes"],
                                           checksum=update["verify"], **into)  # fmt: skip
        return staging, crcs

    def _check_or_write(self, phase: str, dtype: str, segments: list, records: list[Record]):
        if phase == "verify":
            problems = verify_records(self.model, segments, dtype, records)
            return (f"rank {self.rank}: " + "; ".join(problems)) if problems else None, 0
        if phase == "commit":
            return None, write_records(self.model, segments, dtype, records)
        return f"rank {self.rank}: unknown phase {phase!r}", 0

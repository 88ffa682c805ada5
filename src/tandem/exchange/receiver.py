"""The engine side of a push, on each engine rank: check what arrived, then make it live.

Phases (`tandem.engine.weight_update` runs each on every rank before any rank starts the next):

- ``receive``: the transport moves this rank's boxes (dist); nothing for the others;
- ``verify``: names, shapes and dtypes of every record, then the CRC32 of every box where its
  bytes landed (the staging memory, or the live parameter for ``in_place``) against the CRC32
  its sender read from the trainer's tensor;
- ``hold`` (rolling pushes): every landed box copied into the rank's own memory and
  checksummed there, so the senders may go and the rank commits later, from what it holds;
- ``commit``: staged (or held) boxes are copied into the live parameters, which are then
  checksummed again (a mismatch there means the live weights are torn);
- ``abort``: the push failed; the transport drops what it held.

A delta push (`tandem.exchange.delta`) stages its payloads; ``verify`` checks them as staged,
applies the sparse ones to the live boxes (keeping their undo; the engine is paused) and checks
each whole box as it then stands against the trainer's CRC32 of its new box; ``commit`` writes
the dense ones; ``abort`` puts the old values back. A rolling push's verify undoes at once (the
old version serves on), ``hold`` keeps the payloads, and its wave's ``commit`` applies them
all and checks every box again.

Receivers write into views of the existing parameters (``data_ptr`` never changes), each
through its record's `LocalRegion`.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import tensor_crc32
from tandem.exchange.delta import apply_box, dense_values, undo_box
from tandem.exchange.items import Record
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.exchange.transports import TRANSPORTS
from tandem.exchange.transports.base import ReceiverHalf
from tandem.layers.gemm import drop_packed
from tandem.layers.lora import prepare_slot


class WeightSyncError(RuntimeError):
    """A push was rejected or broke; says whether the old weights are still serving."""


def record_problems(model: nn.Module, spec: UpdateSpec, records: list[Record]) -> list[str]:
    """Every problem with this rank's records that needs no bytes: unknown parameters, a dtype
    other than the parameter's, boxes that do not fit their region, unknown sources; a delta
    push's records must each carry a payload (`DeltaBox`) of its stated size."""
    params = dict(model.named_parameters())
    problems = []
    for r in records:
        param = params.get(r.key)
        if param is None:
            problems.append(f"unknown parameter {r.key}")
            continue
        if spec.delta and r.delta is None:
            problems.append(f"{r.key}: no delta")
            continue
        if not spec.delta and param.dtype != DTYPES.get(r.dtype):
            problems.append(f"{r.key}: sent as {r.dtype}, engine holds {param.dtype}")
        try:
            box = r.region.view(param)
        except (IndexError, RuntimeError) as exc:
            problems.append(f"{r.where}: not a region of {tuple(param.shape)} ({exc})")
            continue
        if spec.delta:
            if r.nbytes != r.delta.nbytes or r.box_shape != (r.nbytes,) or r.dtype != "uint8":
                problems.append(
                    f"{r.where}: payload of {r.nbytes} bytes, {r.delta.nbytes} announced"
                )
            elif r.delta.encoding == "dense" and r.nbytes < box.numel() * box.element_size():
                problems.append(f"{r.where}: dense payload of {r.nbytes} bytes is short")
        elif tuple(box.shape) != tuple(r.box_shape):
            problems.append(f"{r.where}: box {r.box_shape} does not fit")
        if not 0 <= r.source < spec.trainers:
            problems.append(f"{r.key}: no trainer rank {r.source}")
    return problems


def hold_landed(
    half: ReceiverHalf, spec: UpdateSpec, records: list[Record], device: torch.device
) -> tuple[list[str], list[torch.Tensor]]:
    """A rolling push, verified, held until its wave: every landed box copied into one buffer
    of this rank's (the senders' staging is not read again: they are answered before the
    wave), then the copies checksummed against what the senders read (the copy is what the
    commit writes). (problems, the copies)."""
    boxes = half.landed(spec, records)
    buf = torch.empty(sum(r.nbytes for r in records), dtype=torch.uint8, device=device)
    held, at = [], 0
    with torch.no_grad():
        for r, box in zip(records, boxes, strict=True):
            mine = buf[at : at + r.nbytes].view(box.dtype).view(box.shape)
            mine.copy_(box)
            held.append(mine)
            at += r.nbytes
    half.release(spec)  # what the transport staged is not read again
    problems = []
    if spec.settings.verify:
        problems = crc_problems(records, [tensor_crc32(b) for b in held], "as held")
    return problems, held


def crc_problems(records: list[Record], crcs: list[int], where: str) -> list[str]:
    return [
        f"checksum mismatch for {r.where} {where}"
        for r, crc in zip(records, crcs, strict=True)
        if r.crc is not None and crc != r.crc
    ]


class RankReceiver:
    """One engine rank's side of every push: a receiver half per transport (kept across
    pushes, with its mappings and buffers), driven phase by phase."""

    def __init__(self, model: nn.Module, rank: int, device: torch.device):
        self.model = model
        self.rank = rank
        self.device = device
        self._halves: dict[str, ReceiverHalf] = {}
        self._held: tuple[int, list[torch.Tensor]] | None = None  # (version, boxes) of `hold`
        # a delta applied at verify: (live box, its undo) to put back if the push fails
        self._undo: list[tuple[torch.Tensor, tuple]] = []

    def handle(
        self, phase: PushPhase, spec: UpdateSpec, records: list[Record]
    ) -> tuple[str | None, int]:
        """Run one phase; (this rank's error or None, bytes it moved). Never raises: the
        engine decides what an error means."""
        name = spec.settings.transport
        half = self._halves.get(name)
        if half is None:
            half = self._halves[name] = TRANSPORTS[name].receiver(
                self.model, self.rank, self.device
            )
        try:
            problems, nbytes = self._run(half, phase, spec, records)
        except Exception as exc:
            problems, nbytes = [f"{type(exc).__name__}: {exc}"], 0
        if problems and phase is not PushPhase.ABORT:
            try:
                half.abort(spec)
            except Exception:  # the push already failed; nothing more to report
                pass
        if spec.adapter is None:  # the phase may have written the live weights (an adapter
            drop_packed(self.model)  # push writes only LoRA slots, which have no packed copy)
        return (f"rank {self.rank}: " + "; ".join(problems)) if problems else None, nbytes

    def _run(self, half: ReceiverHalf, phase: PushPhase, spec: UpdateSpec, records: list[Record]):
        return {
            PushPhase.RECEIVE: self._receive,
            PushPhase.VERIFY: self._verify,
            PushPhase.HOLD: self._hold,
            PushPhase.COMMIT: self._commit,
            PushPhase.ABORT: self._abort,
        }[phase](half, spec, records)

    def _receive(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        return [], half.receive(spec, records)

    def _verify(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        if spec.delta:
            return self._verify_delta(half, spec, records)
        problems = record_problems(self.model, spec, records)
        if not problems and spec.settings.verify:
            where = "in the live parameter" if spec.settings.in_place else "as staged"
            problems = crc_problems(records, half.landed_crcs(spec, records), where)
        return problems, 0

    def _verify_delta(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        """A delta push: the payloads as staged against the CRC32s their senders read; then
        every sparse payload applied to its live box (its undo kept: the window is paused, and
        an abort puts the old values back) and the box as it then stands against the trainer's
        CRC32 of its whole new box. Dense payloads are checked as staged and written at the
        commit."""
        self._undo = []
        problems = record_problems(self.model, spec, records)
        verify = spec.settings.verify
        if not problems and verify:
            problems = crc_problems(records, half.landed_crcs(spec, records), "as staged")
        if problems:
            return problems, 0
        payloads = half.landed(spec, records)
        with torch.no_grad():
            for r, payload, live in zip(records, payloads, half.live(records), strict=True):
                if r.delta.encoding == "dense":
                    continue
                self._undo.append((live, apply_box(live, payload, r.delta)))
                if verify and tensor_crc32(live) != r.delta.crc:
                    problems.append(f"checksum mismatch for {r.where} with its delta applied")
            if spec.settings.rolling:  # the old version serves until this replica's wave
                for live, old in reversed(self._undo):
                    undo_box(live, old)
                self._undo = []
        return problems, 0

    def _commit_delta(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        """The dense payloads of a delta push into their live boxes, each checked there; the
        sparse ones were applied at verify (their undo is dropped), or, a rolling push's, are
        applied now from what the rank held (checked at verify, checked again here)."""
        held = self._held is not None and self._held[0] == spec.version
        payloads = self._held[1] if held else half.landed(spec, records)
        self._held = None
        problems, nbytes = [], 0
        with torch.no_grad():
            for r, payload, live in zip(records, payloads, half.live(records), strict=True):
                if r.delta.encoding == "dense":
                    live.copy_(dense_values(payload, live))
                elif held:
                    apply_box(live, payload, r.delta)
                else:
                    continue
                nbytes += r.nbytes
                if spec.settings.verify and tensor_crc32(live) != r.delta.crc:
                    problems.append(f"checksum mismatch for {r.where} in the live parameter")
        self._undo = []
        half.release(spec)
        return problems, nbytes

    def _hold(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        self._held = None
        problems, held = hold_landed(half, spec, records, self.device)
        if not problems:
            self._held = (spec.version, held)
        return problems, sum(r.nbytes for r in records)

    def _commit(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        if spec.adapter is not None:  # the slot's previous adapter may differ in rank, targets
            prepare_slot(self.model, spec.adapter.slot, spec.adapter.scale)
        if spec.delta:
            return self._commit_delta(half, spec, records)
        if self._held is not None and self._held[0] == spec.version:
            nbytes = self._commit_held(half, records)
        else:
            nbytes = half.commit(spec, records)
        if spec.settings.in_place or not spec.settings.verify:
            return [], nbytes
        crcs = [tensor_crc32(box) for box in half.live(records)]
        return crc_problems(records, crcs, "in the live parameter after commit"), nbytes

    def _commit_held(self, half: ReceiverHalf, records: list[Record]) -> int:
        _, held = self._held
        self._held = None
        if len(held) != len(records):
            raise RuntimeError(f"{len(records)} records to commit, {len(held)} boxes held")
        with torch.no_grad():
            for box, dst in zip(held, half.live(records), strict=True):
                dst.copy_(box)
        return sum(r.nbytes for r in records)

    def _abort(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]):
        self._held = None
        undo, self._undo = self._undo, []
        with torch.no_grad():
            for live, old in reversed(undo):  # a delta applied at verify: the old values back
                undo_box(live, old)
        half.abort(spec)
        return [], 0

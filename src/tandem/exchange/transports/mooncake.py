"""One-sided transport on the Mooncake Transfer Engine (``mooncake-transfer-engine``): memory
registered once, bytes moved by one-sided reads, TCP where the hosts have no RDMA NIC (this
machine) and RDMA where they do (``TANDEM_MOONCAKE_PROTOCOL=rdma``).

A box the trainer holds contiguously, already in the engine's dtype, is read straight out of
the trainer's tensor: the tensor's memory is registered with the process's transfer engine
(pinned while a sender holds it) and only its CRC32 is taken. Every other box is packed into a
staging buffer of the trainer rank's own, registered once and kept for its later pushes. The
rank answers with the staging's handle (segment, address, size) and the address of every box
read in place. The target's ranks then pull, with batched one-sided reads that coalesce boxes
adjacent on both sides: ``staged``, into a landing buffer of their own (registered once),
checked there against the trainers' CRC32s and copied into the parameters on commit;
``in_place``, straight into the live parameter where the box's region is contiguous there
(the parameters registered once; the engine paused while its ranks read; strided boxes land
in the buffer and are copied into place), then checked in the parameters. The trainer's
tensors are read while its ``push`` waits for the answer: they must not change until it
returns. A fleet's replicas all read the trainers' memory (no relay through a peer replica).
Peers find each other by handshake (``P2PHANDSHAKE``: no metadata server);
``TANDEM_MOONCAKE_HOSTNAME`` is the address peers reach this process at (default 127.0.0.1),
``TANDEM_MOONCAKE_DEVICE`` the RDMA devices.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import defaultdict

import torch

from tandem.dtypes import WIRE_DTYPES
from tandem.exchange.checksum import source_crc32
from tandem.exchange.items import Record
from tandem.exchange.settings import UpdateSpec
from tandem.exchange.transports.base import Delivery, ReceiverHalf, SenderHalf, Transport


class MooncakeError(RuntimeError):
    """The transfer engine could not start, register memory or move bytes."""


class ProcessEngine:
    """This process's one transfer engine (made on first use; every half shares it)."""

    _lock = threading.Lock()
    _made: ProcessEngine | None = None

    def __init__(self):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise MooncakeError(
                "transport 'mooncake' needs the Mooncake Transfer Engine: pip install "
                f"'tandem-rl[mooncake]' (and libibverbs1 from the OS) ({exc})"
            ) from None
        hostname = os.environ.get("TANDEM_MOONCAKE_HOSTNAME", "127.0.0.1")
        protocol = os.environ.get("TANDEM_MOONCAKE_PROTOCOL", "tcp")
        self.engine = TransferEngine()
        rc = self.engine.initialize(
            hostname, "P2PHANDSHAKE", protocol, os.environ.get("TANDEM_MOONCAKE_DEVICE", "")
        )
        if rc != 0:
            raise MooncakeError(f"transfer engine did not start on {hostname} ({protocol}): {rc}")
        self.segment = f"{hostname}:{self.engine.get_rpc_port()}"
        self.pins = _Pins(self.engine)

    @classmethod
    def get(cls) -> ProcessEngine:
        with cls._lock:
            if cls._made is None:
                cls._made = cls()
            return cls._made


class RegisteredBuffer:
    """A uint8 buffer registered with the transfer engine; grown (re-registered) on demand and
    unregistered before its memory is freed (when released, or when this is collected: the
    engine refuses a region overlapping one still registered)."""

    def __init__(self):
        self.data: torch.Tensor | None = None
        self._unregister: weakref.finalize | None = None

    def at_least(self, size: int) -> torch.Tensor:
        if self.data is None or self.data.numel() < size:
            self.release()
            data = torch.empty(max(size, 1), dtype=torch.uint8)
            engine = ProcessEngine.get().engine
            rc = engine.register_memory(data.data_ptr(), data.numel())
            if rc != 0:
                raise MooncakeError(f"registering {data.numel()} bytes failed: {rc}")
            self.data = data
            self._unregister = weakref.finalize(self, _unregister, engine, data)
        return self.data

    @property
    def address(self) -> int:
        return self.data.data_ptr()

    def release(self) -> None:
        if self._unregister is not None:
            self._unregister()
        self.data = self._unregister = None


def _unregister(engine, data: torch.Tensor) -> None:
    engine.unregister_memory(data.data_ptr())  # ``data`` is kept alive until this ran


class MooncakeSender(SenderHalf):
    def __init__(self, settings, device, rank):
        super().__init__(settings, device, rank)
        self._staging = RegisteredBuffer()  # kept for the next push
        self._held: set[tuple[int, int]] = set()  # regions of trainer tensors pinned (`_Pins`)
        weakref.finalize(self, _drop_all, ProcessEngine.get().pins, self._held)

    def deliver(self, plan, tensors: dict[str, torch.Tensor]) -> Delivery:
        dtypes = {item.key: WIRE_DTYPES[item.dtype] for item in plan.items}
        readable = self._register(
            {key: t for key, t in tensors.items() if self._in_place(t, dtypes.get(key))}
        )
        buf = self._staging.at_least(plan.size)
        crcs: list[int | None] = []
        moved = [0] * (1 + max((item.dst for item in plan.items), default=-1))
        direct = []  # [staging offset, address] of each box read from the trainer's tensor
        staged = 0
        with torch.no_grad():
            for item, dst in zip(plan.items, self.staged(plan, buf), strict=True):
                src = self.source(tensors, item)
                if item.key in readable and src.is_contiguous():
                    crcs.append(
                        source_crc32(src, WIRE_DTYPES[item.dtype]) if self.settings.verify else None
                    )
                    direct.append([item.offset, src.data_ptr()])
                else:
                    crcs.append(self.write_box(src, dst))
                    staged += item.nbytes
                moved[item.dst] += item.nbytes
        handle = [ProcessEngine.get().segment, self._staging.address, plan.size, direct]
        return Delivery(crcs, moved, handle, bytes_staged=staged)

    @staticmethod
    def _in_place(t: torch.Tensor, dtype: torch.dtype) -> bool:
        return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and t.numel()

    def _register(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Pin each tensor's memory for reading in place (`_Pins.hold`; a region refused is
        staged instead). The keys whose tensors the engine may read in place."""
        ProcessEngine.get().pins.hold(self._held, list(tensors.values()))
        return {key for key, t in tensors.items() if _region(t) in self._held}

    def close(self) -> None:
        self._staging.release()
        self._register({})


def _region(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def _drop_all(pins: _Pins, held: set) -> None:
    for region in held:
        pins.drop(region)
    held.clear()


class _Pins:
    """The process's tensor memory registered for reading in place, counted by the senders
    holding it (two senders of one model share a registration; the engine refuses a region
    registered twice) and kept alive (a tensor is not freed while registered)."""

    def __init__(self, engine):
        self._engine = engine
        self._lock = threading.Lock()
        self._pins: dict[tuple[int, int], list] = {}  # region -> [tensor, holders]

    def hold(self, held: set[tuple[int, int]], tensors: list[torch.Tensor]) -> list:
        """Make ``held`` (one holder's pinned regions) the regions of ``tensors``: its pins on
        memory no longer named dropped first (it may have been freed and reused), then each
        new one taken. The regions the engine refused (they overlap memory registered
        otherwise)."""
        wanted = {_region(t): t for t in tensors}
        for region in [r for r in held if r not in wanted]:
            held.discard(region)
            self.drop(region)
        refused = []
        for region, t in wanted.items():
            if region not in held:
                if self.take(region, t):
                    held.add(region)
                else:
                    refused.append(region)
        return refused

    def take(self, region: tuple[int, int], t: torch.Tensor) -> bool:
        with self._lock:
            pin = self._pins.get(region)
            if pin is None:
                if self._engine.register_memory(*region) != 0:
                    return False  # overlaps memory registered otherwise: staged instead
                pin = self._pins[region] = [t, 0]
            pin[1] += 1
            return True

    def drop(self, region: tuple[int, int]) -> None:
        with self._lock:
            pin = self._pins.get(region)
            if pin is not None:
                pin[1] -= 1
                if pin[1] == 0:
                    self._engine.unregister_memory(region[0])
                    del self._pins[region]


class MooncakeReceiver(ReceiverHalf):
    def __init__(self, model, rank, device):
        super().__init__(model, rank, device)
        self._landing = RegisteredBuffer()  # kept for the next push
        self._params: set[tuple[int, int]] = set()  # live parameters pinned (in place)
        weakref.finalize(self, _drop_all, ProcessEngine.get().pins, self._params)

    def receive(self, spec: UpdateSpec, records: list[Record]) -> int:
        """Read every record from its sender's registered memory (its tensor, or its staging),
        one batch per sender: staged, into this rank's landing buffer (records one after
        another, in order); in place, straight into the live parameter where the record's
        region is contiguous there (the parameters pinned), else through the landing buffer
        and copied into place."""
        in_place = spec.settings.in_place
        live = self.live(records) if in_place else [None] * len(records)
        if in_place:
            self._pin_params()
        lands = [t is None or not t.is_contiguous() for t in live]
        base = self._landing.at_least(
            sum(r.nbytes for r, land in zip(records, lands, strict=True) if land)
        )
        base_ptr = base.data_ptr()
        batches: dict[int, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
        direct: dict[int, dict[int, int]] = {}  # trainer rank -> staging offset -> address
        landed_at, at = [], 0
        for r, target, land in zip(records, live, lands, strict=True):
            handle = spec.staging[r.source] if spec.staging else None
            if handle is None or r.offset + r.nbytes > handle[2]:
                raise MooncakeError(f"no staging of trainer rank {r.source} holds {r.where}")
            if r.source not in direct:
                direct[r.source] = {offset: address for offset, address in handle[3]}
            address = direct[r.source].get(r.offset)
            staged = address is None
            if staged:
                address = handle[1] + r.offset
            to = base_ptr + at if land else target.data_ptr()
            local, remote, lengths = batches[r.source]
            adjacent = bool(local) and land and local[-1] + lengths[-1] == to
            if staged and adjacent and remote[-1] + lengths[-1] == address:
                # adjacent on both sides, in the staging and the landing buffer: one read (a
                # tensor read or written in place is registered on its own, and a read may
                # not cross two registrations)
                lengths[-1] += r.nbytes
            else:
                local.append(to)
                remote.append(address)
                lengths.append(r.nbytes)
            landed_at.append(at if land else None)
            at += r.nbytes if land else 0
        for source, (local, remote, lengths) in batches.items():
            rc = ProcessEngine.get().engine.batch_transfer_sync_read(
                spec.staging[source][0], local, remote, lengths
            )
            if rc != 0:
                raise MooncakeError(
                    f"reading {sum(lengths)} bytes from trainer rank {source} "
                    f"({spec.staging[source][0]}) failed: {rc}"
                )
        if in_place:  # what could not land in place lands now
            with torch.no_grad():
                for r, target, offset in zip(records, live, landed_at, strict=True):
                    if offset is not None:
                        box = base[offset : offset + r.nbytes].view(target.dtype)
                        self.write_box(box.view(r.box_shape), target)
        return sum(r.nbytes for r in records)

    def _pin_params(self) -> None:
        """Register the live parameters' memory for reads in place (kept while they stay
        where they are: an engine's parameters never move between pushes)."""
        refused = ProcessEngine.get().pins.hold(self._params, list(self.model.parameters()))
        if refused:
            raise MooncakeError(f"cannot register parameters' memory {refused}")

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        if spec.settings.in_place:
            return self.live(records)
        data, out, at = self._landing.data, [], 0
        if data is None or data.numel() < sum(r.nbytes for r in records):
            raise MooncakeError("nothing received for this push")
        for r in records:
            out.append(data[at : at + r.nbytes].view(WIRE_DTYPES[r.dtype]).view(r.box_shape))
            at += r.nbytes
        return out


class MooncakeTransport(Transport):
    name = "mooncake"
    modes = ("staged", "in_place")
    delta_pays = True
    sender = MooncakeSender
    receiver = MooncakeReceiver
    device_types = ("cpu",)
    shared_staging = True  # every replica reads the trainers' staging where it is
    pulls = True

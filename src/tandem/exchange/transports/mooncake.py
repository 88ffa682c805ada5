"""One-sided transport on the Mooncake Transfer Engine (``mooncake-transfer-engine``): memory
registered once, bytes moved by one-sided reads, TCP where the hosts have no RDMA NIC (this
machine) and RDMA where they do (``TANDEM_MOONCAKE_PROTOCOL=rdma``).

``staged`` only. Each trainer rank packs its boxes into a staging buffer of its own,
registered with its process's transfer engine once (kept for its later pushes) and answers
with the buffer's handle (segment, address, size). The target's ranks then pull: each reads
its records straight out of the senders' registered memory into a buffer of its own (also
registered once), with batched one-sided reads that coalesce boxes adjacent on both sides,
checks every box there against the trainers' CRC32s and copies it into its parameters on
commit. The trainers' staging is read in place, so a fleet's replicas all read the one
staging (no relay through a peer replica). Peers find each other by handshake
(``P2PHANDSHAKE``: no metadata server); ``TANDEM_MOONCAKE_HOSTNAME`` is the address peers
reach this process at (default 127.0.0.1), ``TANDEM_MOONCAKE_DEVICE`` the RDMA devices.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import defaultdict

import torch

from tandem.exchange.items import Record
from tandem.exchange.settings import UpdateSpec
from tandem.exchange.transports.base import Delivery, ReceiverHalf, SenderHalf, Transport


class MooncakeError(RuntimeError):
    """The transfer engine could not start, register memory or move bytes."""


class _Engine:
    """This process's one transfer engine (made on first use; every half shares it)."""

    _lock = threading.Lock()
    _made: _Engine | None = None

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
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol,
                                    os.environ.get("TANDEM_MOONCAKE_DEVICE", ""))  # fmt: skip
        if rc != 0:
            raise MooncakeError(f"transfer engine did not start on {hostname} ({protocol}): {rc}")
        self.segment = f"{hostname}:{self.engine.get_rpc_port()}"

    @classmethod
    def get(cls) -> _Engine:
        with cls._lock:
            if cls._made is None:
                cls._made = cls()
            return cls._made


class _Registered:
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
            engine = _Engine.get().engine
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
        self._staging = _Registered()  # kept for the next push

    def deliver(self, plan, tensors: dict[str, torch.Tensor]) -> Delivery:
        buf = self._staging.at_least(plan.size)
        crcs, moved = self.write_items(plan, tensors, self.staged(plan, buf))
        return Delivery(crcs, moved, [_Engine.get().segment, self._staging.address, plan.size])

    def close(self) -> None:
        self._staging.release()


class MooncakeReceiver(ReceiverHalf):
    def __init__(self, model, rank, device):
        super().__init__(model, rank, device)
        self._landing = _Registered()  # kept for the next push

    def receive(self, spec: UpdateSpec, records: list[Record]) -> int:
        """Read every record from its sender's registered staging into this rank's landing
        buffer (records one after another, in order), one batch per sender."""
        engine = _Engine.get().engine
        total = sum(r.nbytes for r in records)
        base = self._landing.at_least(total).data_ptr()
        batches: dict[int, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
        at = 0
        for r in records:
            handle = spec.staging[r.source] if spec.staging else None
            if handle is None or r.offset + r.nbytes > handle[2]:
                raise MooncakeError(f"no staging of trainer rank {r.source} holds {r.where}")
            local, remote, lengths = batches[r.source]
            if (
                local
                and local[-1] + lengths[-1] == base + at
                and (remote[-1] + lengths[-1] == handle[1] + r.offset)
            ):
                lengths[-1] += r.nbytes  # adjacent on both sides: one read
            else:
                local.append(base + at)
                remote.append(handle[1] + r.offset)
                lengths.append(r.nbytes)
            at += r.nbytes
        for source, (local, remote, lengths) in batches.items():
            rc = engine.batch_transfer_sync_read(spec.staging[source][0], local, remote, lengths)
            if rc != 0:
                raise MooncakeError(
                    f"reading {sum(lengths)} bytes from trainer rank {source} "
                    f"({spec.staging[source][0]}) failed: {rc}"
                )
        return total

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        data, dtype, out, at = self._landing.data, self.dtype(spec), [], 0
        if data is None or data.numel() < sum(r.nbytes for r in records):
            raise MooncakeError("nothing received for this push")
        for r in records:
            out.append(data[at : at + r.nbytes].view(dtype).view(r.box_shape))
            at += r.nbytes
        return out


class MooncakeTransport(Transport):
    name = "mooncake"
    modes = ("staged",)
    sender = MooncakeSender
    receiver = MooncakeReceiver
    device_types = ("cpu",)
    shared_staging = True  # every replica reads the trainers' staging where it is
    pulls = True

"""Same-node transport between CUDA processes (``staged``): each trainer rank stages its boxes
in a CUDA buffer and hands the engine ranks an IPC handle to it (plain bytes and ints, sent as
msgpack); engine ranks map it, check every box there and copy device to device into their
parameters on commit. Written to the CUDA IPC API torch itself uses between processes;
exercised by the `gpu` tests when a GPU is present.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from tandem.dtypes import WIRE_DTYPES
from tandem.exchange.items import Record
from tandem.exchange.settings import UpdateSpec
from tandem.exchange.transports.base import Delivery, ReceiverHalf, SenderHalf, Transport


class CudaIpcSender(SenderHalf):
    def deliver(self, plan, tensors: dict[str, torch.Tensor]) -> Delivery:
        buf = torch.empty(plan.size, dtype=torch.uint8, device=self.device)
        crcs, moved = self.write_items(plan, tensors, self.staged(plan, buf))
        torch.cuda.synchronize(buf.device)
        # the buffer stays alive (``keep``) until the engine has answered
        return Delivery(crcs, moved, export_handle(buf), keep=buf)


class CudaIpcReceiver(ReceiverHalf):
    def __init__(self, model, rank, device):
        super().__init__(model, rank, device)
        self._mapped: dict[int, CudaStaging] = {}  # this push's trainer buffers, by rank
        self._version: int | None = None

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        if self._version != spec.version:
            self.abort(spec)
            self._version = spec.version
        for i in sorted({r.source for r in records}):
            if i not in self._mapped:
                self._mapped[i] = CudaStaging(spec.staging[i])
        return [
            self._mapped[r.source]
            .tensor(r.offset, r.nbytes, WIRE_DTYPES[r.dtype])
            .view(r.box_shape)
            for r in records
        ]

    def commit(self, spec: UpdateSpec, records: list[Record]) -> int:
        try:
            return super().commit(spec, records)
        finally:
            self.abort(spec)  # the trainers free their buffers once the engine answers

    def abort(self, spec: UpdateSpec) -> None:
        for staging in self._mapped.values():
            staging.close()
        self._mapped = {}
        self._version = None


def export_handle(buf: torch.Tensor) -> list:
    """An IPC handle to a contiguous uint8 CUDA tensor that starts its storage."""
    if not buf.is_cuda or buf.dtype != torch.uint8 or buf.storage_offset() != 0:
        raise ValueError("cuda_ipc stages in a fresh contiguous uint8 CUDA tensor")
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        buf.untyped_storage()._share_cuda_()
    )
    return [
        device,
        handle,
        size,
        offset,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
        buf.numel(),
    ]


class CudaStaging:
    """A trainer rank's staged boxes, mapped into this engine process through its handle."""

    def __init__(self, handle: list):
        device, ipc, size, offset, ref_handle, ref_offset, event_handle, event_sync, n = handle
        self.data = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([n]),
            (1,),
            0,
            torch.storage.TypedStorage,
            torch.uint8,
            device,
            ipc,
            size,
            offset,
            False,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        )

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.data.numel():
            raise ValueError(f"record [{offset}, {offset + nbytes}) outside the staging buffer")
        return self.data[offset : offset + nbytes].view(dtype)

    def close(self) -> None:
        torch.cuda.synchronize(self.data.device)  # our copies finish before the trainer frees it
        self.data = None


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    modes = ("staged",)
    sender = CudaIpcSender
    receiver = CudaIpcReceiver
    device_types = ("cuda",)
    shared_staging = True

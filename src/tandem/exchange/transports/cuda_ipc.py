"""Same-node transport between CUDA processes: each trainer rank stages its boxes in a CUDA
buffer and hands the engine ranks an IPC handle to it (plain bytes and ints, sent as msgpack);
engine ranks map it and copy device to device into their parameters. Written to the CUDA IPC
API torch itself uses between processes; exercised by the `gpu` tests when a GPU is present.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor


def export_handle(buf: torch.Tensor) -> list:
    """An IPC handle to a contiguous uint8 CUDA tensor that starts its storage."""
    if not buf.is_cuda or buf.dtype != torch.uint8 or buf.storage_offset() != 0:
        raise ValueError("cuda_ipc stages in a fresh contiguous uint8 CUDA tensor")
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = buf.untyped_storage()._share_cuda_()  # fmt: skip
    return [device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync,
            buf.numel()]  # fmt: skip


class CudaStaging:
    """A trainer rank's staged boxes, mapped into this engine process through its handle."""

    def __init__(self, handle: list):
        device, ipc, size, offset, ref_handle, ref_offset, event_handle, event_sync, n = handle
        self.data = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([n]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
            device, ipc, size, offset, False, ref_handle, ref_offset, event_handle, event_sync,
        )  # fmt: skip

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.data[offset : offset + nbytes].view(dtype)

    def view(self, offset: int, nbytes: int):
        """Host bytes, for CRC32 (a device-to-host copy: verification costs on this path)."""
        return self.data[offset : offset + nbytes].cpu().numpy().data

    def close(self) -> None:
        torch.cuda.synchronize(self.data.device)  # our copies finish before the trainer frees it
        self.data = None

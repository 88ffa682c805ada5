"""Engine parameters in shared memory, so a trainer rank on the same host writes each box
straight into the live parameter: one memcpy (the shm transport's ``in_place`` mode).

An engine rank on CPU moves its parameters, once at start-up, into one anonymous
shared-memory file (``memfd_create``): it has no name anywhere, so nothing can leak — the
kernel frees it when the last process holding it exits, SIGKILL included. A trainer rank
opens it through ``/proc/PID/fd/FD``, which the kernel allows only to processes of the same
user (the access rule of an owner-only segment), checks its inode and size (so a recycled pid
or fd is refused), and maps it once for all later pushes.
"""

from __future__ import annotations

import mmap
import os
import weakref

import torch
from torch import nn

ALIGN = 64  # every parameter starts on a cache line


class ParamArena:
    """One rank's parameters, moved into a memfd (``data_ptr`` changes here, once, before any
    push; never afterwards). Tied parameters stay one tensor."""

    def __init__(self, model: nn.Module):
        params = list(model.named_parameters())  # a tied parameter once
        offsets, size = [], 0
        for _, p in params:
            offsets.append(size)
            size += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        self.fd = os.memfd_create("tandem-params", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)  # the mapping outlives it while tensors do
        os.ftruncate(self.fd, max(size, 1))
        self.size = size
        self._map = mmap.mmap(self.fd, max(size, 1))
        self.entries = []
        with torch.no_grad():
            for (name, p), offset in zip(params, offsets, strict=True):
                view = torch.frombuffer(self._map, dtype=p.dtype, count=p.numel(), offset=offset)
                view = view.view(p.shape)
                view.copy_(p.data)
                p.data = view
                self.entries.append([name, offset, list(p.shape)])

    def to_wire(self) -> list:
        """[pid, fd, inode, size, [[key, offset, shape], ...]] for `MappedArena`."""
        return [os.getpid(), self.fd, os.fstat(self.fd).st_ino, self.size, self.entries]


class MappedArena:
    """An engine rank's `ParamArena`, mapped into a trainer process (read-write)."""

    def __init__(self, wire: list):
        pid, fd, inode, size, entries = wire
        self.key = (pid, fd, inode)
        path = f"/proc/{pid}/fd/{fd}"
        try:
            handle = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise RuntimeError(f"cannot open engine rank's parameters at {path}: {exc}") from None
        try:
            st = os.fstat(handle)
            if (st.st_ino, st.st_size) != (inode, max(size, 1)):
                raise RuntimeError(f"{path} is not the engine's parameter arena any more")
            self._map = mmap.mmap(handle, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(handle)
        self._entries = {key: (offset, tuple(shape)) for key, offset, shape in entries}

    def param(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The live parameter ``key`` of that rank (no copy)."""
        offset, shape = self._entries[key]
        count = 1
        for n in shape:
            count *= n
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset).view(shape)

"""Same-host shared memory with no name: what the shm transport stages in and writes through.

A process makes `SharedMemory` with ``memfd_create``: an anonymous file that appears nowhere
in the filesystem, so nothing can be planted under its name or left behind — the kernel frees
it when the last process holding it (descriptor or mapping) exits, SIGKILL included. Another
process on the host maps it (`MappedMemory`) by opening ``/proc/PID/fd/FD``, which the kernel
allows only to a process of the same user (the ptrace read check), after checking its inode
and size, so a recycled pid or descriptor is refused. Both sides map it once and keep the
mapping for later pushes, so a push touches no fresh pages.
"""

from __future__ import annotations

import mmap
import os
import weakref

import torch


class SharedMemory:
    """``size`` bytes of nameless shared memory made by this process."""

    def __init__(self, size: int, name: str = "tandem"):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)  # the mapping outlives it while tensors do
        os.ftruncate(self.fd, max(size, 1))
        self.map = mmap.mmap(self.fd, max(size, 1))

    @property
    def data(self) -> torch.Tensor:
        """The whole buffer as a uint8 tensor (no copy)."""
        return _bytes(self.map, self.size)

    def to_wire(self) -> list:
        """[pid, fd, inode, size]: what `MappedMemory` needs to map it in another process."""
        return [os.getpid(), self.fd, os.fstat(self.fd).st_ino, self.size]


class MappedMemory:
    """Another process's `SharedMemory`, mapped into this one (read-write)."""

    def __init__(self, wire: list, what: str = "shared memory"):
        pid, fd, inode, size = wire
        self.key = (pid, fd, inode)
        self.size = size
        path = f"/proc/{pid}/fd/{fd}"
        try:
            handle = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise RuntimeError(f"cannot open the peer's {what} at {path}: {exc}") from None
        try:
            st = os.fstat(handle)
            if (st.st_ino, st.st_size) != (inode, max(size, 1)):
                raise RuntimeError(f"{path} is not the peer's {what} any more")
            self.map = mmap.mmap(handle, max(size, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(handle)

    @property
    def data(self) -> torch.Tensor:
        return _bytes(self.map, self.size)

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of ``nbytes`` at ``offset`` (no copy)."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"record [{offset}, {offset + nbytes}) outside {self.size} bytes")
        return torch.frombuffer(self.map, dtype=dtype, count=nbytes // dtype.itemsize,
                                offset=offset)  # fmt: skip

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"record [{offset}, {offset + nbytes}) outside {self.size} bytes")
        return memoryview(self.map)[offset : offset + nbytes]

    def close(self) -> None:
        """Nothing to do: the mapping stays for later pushes; it goes with this object."""


def _bytes(buf: mmap.mmap, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8, count=size)

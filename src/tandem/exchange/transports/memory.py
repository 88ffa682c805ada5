"""Same-host shared memory with no name: what the shm transport stages in and writes through,
and the engine parameters that live in it (`ParamArena`).

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
from torch import nn


class SharedMemory:
    """``size`` bytes of nameless shared memory made by this process."""

    def __init__(self, size: int, name: str = "tandem"):
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(size, 1))
            self.map = mmap.mmap(self.fd, max(size, 1))
        except BaseException:
            os.close(self.fd)
            raise
        # The descriptor `handle` names lives exactly as long as the memory: it closes with
        # the mapping (which tensors viewing it keep), not with this object, and not at
        # interpreter exit while tensors still view the mapping (the kernel closes it then).
        # Closed with this object, it went while the mapping's own descriptor kept the memory:
        # a handle of live memory that no longer opened.
        weakref.finalize(self.map, os.close, self.fd).atexit = False

    @property
    def data(self) -> torch.Tensor:
        """The whole buffer as a uint8 tensor (no copy)."""
        return _bytes(self.map, self.size)

    def handle(self) -> list:
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
            raise RuntimeError(
                f"cannot open the peer's {what} at {path} ({_whereabouts(pid, fd)}): {exc}"
            ) from None
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
        return torch.frombuffer(
            self.map, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset
        )

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"record [{offset}, {offset + nbytes}) outside {self.size} bytes")
        return memoryview(self.map)[offset : offset + nbytes]

    def close(self) -> None:
        """Nothing to do: the mapping stays for later pushes; it goes with this object."""


def _whereabouts(pid: int, fd: int) -> str:
    """Why ``/proc/PID/fd/FD`` did not open, as far as ``/proc`` tells: the process is gone,
    exited (killed, not yet reaped: ``/proc/PID`` stays, its descriptors do not), or alive
    without that descriptor (the memory was freed, or the process is exiting)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"process {pid} gone"
    if state in ("Z", "X"):
        return f"process {pid} exited"
    return f"process {pid} alive, holding no descriptor {fd}: its memory was freed, or it exits"


def _bytes(buf: mmap.mmap, size: int) -> torch.Tensor:
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8, count=size)


ALIGN = 64  # every parameter starts on a cache line


class ParamArena:
    """One rank's parameters, moved into shared memory (``data_ptr`` changes here, once,
    before any push; never afterwards). Tied parameters stay one tensor."""

    def __init__(self, model: nn.Module):
        params = list(model.named_parameters())  # a tied parameter once
        offsets, size = [], 0
        for _, p in params:
            offsets.append(size)
            size += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        self.memory = SharedMemory(size, "tandem-params")
        self.entries = []
        with torch.no_grad():
            for (name, p), offset in zip(params, offsets, strict=True):
                view = torch.frombuffer(
                    self.memory.map, dtype=p.dtype, count=p.numel(), offset=offset
                ).view(p.shape)
                view.copy_(p.data)
                p.data = view
                self.entries.append([name, offset, list(p.shape)])

    def release(self) -> None:
        """Free the memory's pages (sleep level 2): mapping and addresses stay, the pages read
        as zeros until written again."""
        if self.memory.size:
            self.memory.map.madvise(mmap.MADV_REMOVE)

    def handle(self) -> list:
        """[pid, fd, inode, size, [[key, offset, shape], ...]] for `MappedArena`."""
        return [*self.memory.handle(), self.entries]


class MappedArena:
    """An engine rank's `ParamArena`, mapped into a trainer process (read-write)."""

    def __init__(self, wire: list):
        *memory, entries = wire
        self.memory = MappedMemory(memory, "parameter arena")
        self.key = self.memory.key
        self._entries = {key: (offset, tuple(shape)) for key, offset, shape in entries}

    def param(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """The live parameter ``key`` of that rank (no copy)."""
        offset, shape = self._entries[key]
        count = 1
        for n in shape:
            count *= n
        return self.memory.tensor(offset, count * dtype.itemsize, dtype).view(shape)

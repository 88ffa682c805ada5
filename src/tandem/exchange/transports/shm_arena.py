"""Engine parameters in shared memory, so a trainer rank on the same host writes each box
straight into the live parameter: one memcpy (the shm transport's ``in_place`` mode).

An engine rank on CPU moves its parameters, once at start-up, into one `SharedMemory` (a
memfd: no name, freed with the last process holding it); a trainer rank maps it once, through
`MappedMemory` (same user only; inode and size checked), for all later pushes.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.exchange.transports.shm import MappedMemory, SharedMemory

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
                view = torch.frombuffer(self.memory.map, dtype=p.dtype, count=p.numel(),
                                        offset=offset).view(p.shape)  # fmt: skip
                view.copy_(p.data)
                p.data = view
                self.entries.append([name, offset, list(p.shape)])

    def to_wire(self) -> list:
        """[pid, fd, inode, size, [[key, offset, shape], ...]] for `MappedArena`."""
        return [*self.memory.to_wire(), self.entries]


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

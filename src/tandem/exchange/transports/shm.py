"""Same-host transport through an OS shared-memory segment (``/dev/shm``).

The sender creates one segment per push with owner-only permissions and an unguessable name,
packs every transfer's box into it (converted to the engine's dtype), and the receivers map it
read-only and copy each box into place. The segment belongs to the sender: the engine allocates
nothing the size of the model.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def new_name() -> str:
    return f"tandem-{secrets.token_hex(16)}"


def unlink(path: str) -> None:
    """Remove a segment by path (only tandem's own names under /dev/shm)."""
    _checked(Path(path)).unlink(missing_ok=True)


def _checked(path: Path) -> Path:
    if path.parent != SHM_DIR or not path.name.startswith("tandem-") or "/" in path.name:
        raise ValueError(f"not a tandem shared-memory segment: {path}")
    return path


class ShmSegment:
    """A named shared-memory file mapped into this process."""

    def __init__(self, path: Path, size: int, *, create: bool):
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size, 1))
            self._map = mmap.mmap(fd, max(size, 1))
        finally:
            os.close(fd)

    @classmethod
    def create(cls, size: int, name: str | None = None) -> ShmSegment:
        """A new segment (owner-only, never an existing file); ``name`` from `new_name`."""
        if not SHM_DIR.is_dir():
            raise RuntimeError("the shm transport needs /dev/shm (Linux)")
        return cls(_checked(SHM_DIR / (name or new_name())), size, create=True)

    @classmethod
    def open(cls, path: str, size: int) -> ShmSegment:
        return cls(_checked(Path(path)), size, create=False)

    @property
    def data(self) -> torch.Tensor:
        """The whole segment as a uint8 tensor (no copy)."""
        if self.size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=self.size)

    def tensor(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor view of ``nbytes`` at ``offset`` (no copy)."""
        if offset + nbytes > self.size:
            raise ValueError(f"record [{offset}, {offset + nbytes}) outside segment of {self.size}")
        return torch.frombuffer(
            self._map, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset
        )

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._map)[offset : offset + nbytes]

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive; the mapping goes with it
            pass

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

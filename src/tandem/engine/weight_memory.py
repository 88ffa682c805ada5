"""Whether a rank's parameters hold memory: `sleep(level=2)` releases it, a push or
`reload_weights` fills it again.

On CPU the parameters live in the rank's shared-memory arena (`ParamArena`): releasing punches
its pages out (the mapping, every ``data_ptr`` and the trainers' mappings of it stay; the
pages read as zeros and come back as they are written). Elsewhere each parameter's storage is
resized to nothing and back (the data pointer changes; written for CUDA, untested on a GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine import host_memory
from tandem.engine.messages import ReleaseWeights, ReloadWeights, RestoreWeights
from tandem.errors import ModelLoadError
from tandem.exchange.transports.memory import ParamArena
from tandem.layers.gemm import drop_packed
from tandem.layers.placement import unique_parameters
from tandem.models.loader import ModelSpec, load_weights


class WeightMemory:
    def __init__(self, model: nn.Module, spec: ModelSpec, arena: ParamArena | None):
        self.model, self.spec, self.arena = model, spec, arena
        self.released = False
        self._storages: dict[int, tuple[torch.UntypedStorage, int]] = {}  # data_ptr -> size

    def handle(self, msg: ReleaseWeights | RestoreWeights | ReloadWeights) -> str | None:
        """Carry out one control message; the error to report, or None."""
        error = None
        if isinstance(msg, ReleaseWeights):
            self.release()
        elif isinstance(msg, RestoreWeights):
            self.restore()
        else:
            try:
                self.reload()
            except ModelLoadError as exc:
                error = str(exc)
        drop_packed(self.model)  # released (their memory too), zeroed or read again
        if isinstance(msg, ReleaseWeights):
            host_memory.release_freed()
        return error

    def release(self) -> None:
        if self.released:
            return
        if self.arena is not None:
            self.arena.release()
        else:
            for param in unique_parameters(self.model):
                storage = param.untyped_storage()
                self._storages.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
            for storage, _ in self._storages.values():
                storage.resize_(0)
        self.released = True

    def restore(self) -> None:
        """Memory back, zeroed (a push writes every canonical box; vocab padding stays zero)."""
        if not self.released:
            return
        if self.arena is None:
            for storage, nbytes in self._storages.values():
                storage.resize_(nbytes)
            self._storages.clear()
            with torch.no_grad():
                for param in unique_parameters(self.model):
                    param.zero_()
        self.released = False

    def reload(self) -> None:
        """Every parameter read from the checkpoint again (what the engine loaded at start)."""
        self.restore()
        load_weights(self.model, self.spec)

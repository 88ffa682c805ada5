"""The trainer side: `WeightSender(model, llm).push(version)`.

The sender describes what its model holds (canonical boxes), asks the engine what each rank
holds, plans once (cached while layouts are unchanged), packs exactly the planned boxes —
converted to the engine's dtype, so fewer bytes travel — and has the engine verify, then commit.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from tandem.exchange.adapters.dtensor import dtensor_layout
from tandem.exchange.plan import PlanCache, local_slices
from tandem.exchange.receiver import _DTYPES, Record
from tandem.exchange.transports.shm import ShmSegment


@dataclass(frozen=True, slots=True)
class PushStats:
    version: int
    bytes_sent: int
    bytes_needed: int  # what the engine's ranks hold, in the engine's dtype
    seconds: float
    transport: str
    num_transfers: int


class WeightSender:
    """Push a trainer model's weights into a tandem engine, in place.

    ``model``: an ``nn.Module`` whose parameter names are the Hugging Face names (plain, or
    FSDP2/DTensor-sharded). ``target``: an `LLM` in this process. ``verify=True`` checks a CRC32
    of every box on the engine before anything is written (a mismatch rejects the update)."""

    TRANSPORTS = ("shm",)

    def __init__(self, model: nn.Module, target, *, transport: str = "auto", verify: bool = True):
        if transport not in ("auto", *self.TRANSPORTS):
            raise ValueError(f"transport must be one of {('auto', *self.TRANSPORTS)}")
        self.model = model
        self.engine = target.engine
        self.transport = "shm"
        self.verify = verify
        self._plans = PlanCache()

    def push(self, version: int | None = None) -> PushStats:
        start = time.perf_counter()
        version = self.engine.weight_version + 1 if version is None else version
        receivers = self.engine.weight_layouts()
        layout = dtensor_layout(self.model, rank=0)
        plan = self._plans.get([layout], receivers)
        dtype_name = self.engine.config.dtype
        dtype = _DTYPES[dtype_name]
        local = {name: _local(p) for name, p in self.model.named_parameters()}
        sizes = [t.numel * dtype.itemsize for t in plan.transfers]
        segment = ShmSegment.create(sum(sizes))
        try:
            records: dict[int, list] = defaultdict(list)
            offset = 0
            with torch.no_grad():
                for t, nbytes in zip(plan.transfers, sizes, strict=True):
                    src = local[t.src_key][local_slices(t.src_piece, t.box)]
                    box_shape = tuple(b - a for a, b in t.box)
                    out = segment.tensor(offset, nbytes, dtype).view(box_shape)
                    out.copy_(src.t() if t.src_piece.transposed else src)
                    crc = zlib.crc32(segment.view(offset, nbytes)) if self.verify else None
                    slices = tuple((s.start, s.stop) for s in local_slices(t.dst_piece, t.box))
                    rec = Record(offset, nbytes, t.dst_key, slices, box_shape,
                                 t.dst_piece.transposed, crc)  # fmt: skip
                    records[t.dst].append(rec.to_wire())
                    offset += nbytes
            update = {"version": version, "segment": str(segment.path), "size": segment.size,
                      "dtype": dtype_name}  # fmt: skip
            self._before_apply(segment)
            self.engine.update_weights(update, records)
        finally:
            segment.close()
            segment.unlink()
        needed = sum(_numel(r.piece.box) * dtype.itemsize for lay in receivers for r in lay.regions)
        return PushStats(version, offset, needed, time.perf_counter() - start, self.transport,
                         len(plan.transfers))  # fmt: skip

    def _before_apply(self, segment: ShmSegment) -> None:
        """Test hook: runs after packing, before the engine reads the segment."""


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n

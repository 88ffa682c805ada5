"""One vLLM worker's side of a push: tandem's transports bring this worker's boxes, vLLM's own
reload loads them, and what vLLM's kernels then compute with is checked against the trainer.

vLLM's CPU build keeps no plain linear weight to write into: after loading, each linear layer's
weight is repacked for oneDNN (or sgl-kernel) and the plain tensor dropped. So a push into
vLLM is always staged (``mode="staged"``): the boxes land in the transport's staging memory and
are checksummed there (``verify``); the commit hands them, as checkpoint tensors, to the
worker's ``reload_weights`` (vLLM's in-place, layer-by-layer reload that RL engines use), which
runs vLLM's weight loaders and repacking; then every box is read back from the live layers (a
linear layer through its own kernel, multiplying the identity) and checksummed against the CRC32
its trainer rank read. A worker receives only its own boxes; a canonical tensor it holds part of
reaches vLLM's loader as a full-shape tensor whose other rows are zeros, which the loader's
tensor-parallel slicing never reads.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import tensor_crc32
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import crc_problems, record_problems
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.exchange.transports import TRANSPORTS
from tandem.exchange.transports.base import ReceiverHalf
from tandem.integrations.vllm.messages import PhaseReply
from tandem.layers.placement import Piece


class LocalShapes:
    """The worker's parameters in checkpoint format, as meta tensors: what a record is checked
    against before any byte is read (`record_problems` needs names, shapes and the dtype)."""

    def __init__(self, layout: RankLayout, dtype: torch.dtype):
        self._params = {key: torch.empty(shape, dtype=dtype, device="meta")
                        for key, shape in layout.local_shapes.items()}  # fmt: skip

    def named_parameters(self):
        return self._params.items()


class VllmReceiver:
    """Kept by a worker across pushes (its transports' halves with their mappings)."""

    def __init__(self, model: nn.Module, layout: RankLayout, reload, device: torch.device):
        self.model = model
        self.layout = layout
        self.reload = reload  # the worker's ``reload_weights``
        self.device = device
        self.dtype = DTYPES[layout.dtype]
        self.shapes = LocalShapes(layout, self.dtype)
        self.pieces: dict[str, list[Piece]] = defaultdict(list)
        for region in layout.regions:
            self.pieces[region.key].append(region.piece)
        self._halves: dict[str, ReceiverHalf] = {}

    def run(self, phase: PushPhase, spec: UpdateSpec, records: list[Record]) -> PhaseReply:
        half = self._half(spec.settings.transport)
        torn = False
        try:
            if phase is PushPhase.RECEIVE:
                return PhaseReply(None, half.receive(spec, records))
            if phase is PushPhase.VERIFY:
                problems = record_problems(self.shapes, spec, records)
                if not problems and spec.settings.verify:
                    crcs = half.landed_crcs(spec, records)
                    problems = crc_problems(records, crcs, "as staged")
                return self._reply(half, spec, problems, 0)
            if phase is PushPhase.COMMIT:
                boxes = half.landed(spec, records)
                torn = True  # from here vLLM's live weights change
                nbytes = self._load(records, boxes)
                half.release(spec)
                problems = []
                if spec.settings.verify:
                    crcs = [tensor_crc32(box) for box in self.live(records)]
                    problems = crc_problems(records, crcs, "in vLLM's live weights after commit")
                return self._reply(half, spec, problems, nbytes, torn=bool(problems))
            half.abort(spec)
            return PhaseReply(None, 0)
        except Exception as exc:
            return self._reply(half, spec, [f"{type(exc).__name__}: {exc}"], 0, torn=torn)

    def _reply(self, half: ReceiverHalf, spec: UpdateSpec, problems: list[str], nbytes: int,
               torn: bool = False) -> PhaseReply:  # fmt: skip
        if not problems:
            return PhaseReply(None, nbytes)
        try:
            half.abort(spec)
        except Exception:  # the push already failed; nothing more to report
            pass
        return PhaseReply("; ".join(problems), nbytes, torn)

    def _half(self, name: str) -> ReceiverHalf:
        if name not in self._halves:
            self._halves[name] = TRANSPORTS[name].receiver(self.shapes, self.layout.rank,
                                                           self.device)  # fmt: skip
        return self._halves[name]

    def _load(self, records: list[Record], boxes: list[torch.Tensor]) -> int:
        """The landed boxes into vLLM through its reload, one canonical tensor at a time (in
        the order of the layout, so each layer is repacked as soon as it is complete)."""
        by_name: dict[str, list[tuple[tuple, torch.Tensor]]] = defaultdict(list)
        for record, box in zip(records, boxes, strict=True):
            piece, canonical = self._canonical(record)
            by_name[piece.name].append((canonical, box))
        shapes = self.layout.canonical_shapes()

        def tensors():
            for name, parts in by_name.items():
                full = shapes[name]
                if len(parts) == 1 and parts[0][1].shape == full:
                    yield name, parts[0][1]  # the whole tensor: vLLM copies it from staging
                    continue
                tensor = torch.zeros(full, dtype=self.dtype, device=self.device)
                for box, value in parts:
                    tensor[tuple(slice(a, b) for a, b in box)].copy_(value)
                yield name, tensor

        self.reload(weights_iterator=tensors())
        return sum(r.nbytes for r in records)

    def _canonical(self, record: Record) -> tuple[Piece, tuple[tuple[int, int], ...]]:
        """The piece a record's region lies in, and the canonical box it covers."""
        for piece in self.pieces.get(record.key, ()):
            box = []
            dims = zip(record.region.slices, piece.box, piece.offset, piece.box_shape, strict=True)
            for (start, stop), (b0, _), offset, size in dims:
                if start < offset or stop > offset + size:
                    break
                box.append((b0 + start - offset, b0 + stop - offset))
            else:
                return piece, tuple(box)
        raise ValueError(f"{record.where}: not a region this worker holds")

    def live(self, records: list[Record]) -> list[torch.Tensor]:
        """Each record's box as vLLM now computes with it, in canonical orientation."""
        cache: dict[str, torch.Tensor] = {}
        out = []
        for r in records:
            if r.key not in cache:
                cache[r.key] = self._read_back(r.key)
            out.append(r.region.view(cache[r.key]))
        return out

    @torch.no_grad()
    def _read_back(self, key: str) -> torch.Tensor:
        """The local parameter ``key`` in checkpoint format, as vLLM's forward uses it: a
        linear layer's weight (which vLLM's CPU build keeps only repacked) by running the
        layer's own matmul on the identity; anything else as the parameter itself."""
        module_name, _, attr = key.rpartition(".")
        module = self.model.get_submodule(module_name)
        shape = self.layout.local_shapes[key]
        apply = getattr(getattr(module, "quant_method", None), "apply", None)
        if attr == "weight" and len(shape) == 2 and apply is not None and _is_matmul(module):
            eye = torch.eye(shape[1], dtype=self.dtype, device=self.device)
            return apply(module, eye, None).t()[: shape[0]]
        param = getattr(module, attr)
        if tuple(param.shape) != tuple(shape):
            raise ValueError(f"{key}: vLLM holds shape {tuple(param.shape)}, the layout table "
                             f"says {tuple(shape)}")  # fmt: skip
        return param


def _is_matmul(module: nn.Module) -> bool:
    """A layer whose weight vLLM multiplies by (a linear layer, the LM head), as opposed to
    one it looks rows up in (the token embedding)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, (LinearBase, ParallelLMHead))

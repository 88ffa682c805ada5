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
        self.users = _users(model, list(layout.local_shapes))

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
                    problems = [f"checksum mismatch for {r.where} in vLLM's live weights after "
                                f"commit ({how})" for r, how, box in self.live(records)
                                if r.crc is not None and tensor_crc32(box) != r.crc]  # fmt: skip
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
        for key in {r.key for r in records}:
            for _, module, _ in self.users[key][1:]:
                module.quant_method.process_weights_after_loading(module)
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

    def live(self, records: list[Record]) -> list[tuple[Record, str, torch.Tensor]]:
        """Each record's box as vLLM now computes with it, in canonical orientation, every way
        a layer uses it: (record, how, box)."""
        cache: dict[str, list[tuple[str, torch.Tensor]]] = {}
        out = []
        for r in records:
            if r.key not in cache:
                cache[r.key] = [
                    view
                    for user in self.users[r.key]
                    for view in _read_back(
                        *user, tuple(self.layout.local_shapes[r.key]), self.dtype, self.device
                    )
                ]
            out += [(r, how, r.region.view(tensor)) for how, tensor in cache[r.key]]
        return out


def _users(model: nn.Module, keys: list[str]) -> dict[str, list[tuple[str, nn.Module, str]]]:
    """For each parameter, every (module name, module, attribute) holding it: the module its
    name points at first, then any other a tied tensor is shared with (an LM head tied to the
    token embedding). vLLM's reload re-processes only the first of a tied tensor's layers."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = defaultdict(list)
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            owners[id(param)].append((name, module, attr))
    users = {}
    for key in keys:
        module_name, _, attr = key.rpartition(".")
        param = getattr(model.get_submodule(module_name), attr)
        found = owners[id(param)]
        users[key] = sorted(found, key=lambda user: user[0] != module_name)
        if len({id(m) for _, m, _ in found}) != len(found):
            raise ValueError(f"{key}: one module holds it twice")
        missing = [n for n, m, _ in users[key][1:] if getattr(m, "quant_method", None) is None]
        if missing:
            raise ValueError(f"{key}: shared with {missing}, which vLLM cannot re-process")
    return users


@torch.no_grad()
def _read_back(
    name: str,
    module: nn.Module,
    attr: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[str, torch.Tensor]]:
    """A parameter of ``module`` in checkpoint format, every way the module's forward uses it:
    the plain parameter where vLLM keeps it (norms, biases, the token embedding), and, for a
    2-D weight the module multiplies by (linear layers, whose plain weight vLLM's CPU build
    drops after repacking; the LM head, or the embedding's own matmul), the module's matmul
    run on the identity."""
    views = []
    param = getattr(module, attr)
    if tuple(param.shape) == shape:
        views.append((f"tensor in {name}", param))
    elif not _is_linear(module):
        raise ValueError(f"{name}.{attr}: vLLM holds shape {tuple(param.shape)}, the layout "
                         f"table says {shape}")  # fmt: skip
    apply = getattr(getattr(module, "quant_method", None), "apply", None)
    if attr == "weight" and len(shape) == 2 and apply is not None:
        eye = torch.eye(shape[1], dtype=dtype, device=device)
        views.append((f"matmul in {name}", apply(module, eye, None).t()[: shape[0]]))
    return views


def _is_linear(module: nn.Module) -> bool:
    """A vLLM linear layer (its CPU build may drop the plain weight after repacking it)."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)

"""One vLLM worker's side of a push: tandem's transports bring this worker's boxes, they go
into vLLM's live layers, and what vLLM's kernels then compute with is checked against the
trainer.

vLLM's CPU build keeps no plain linear weight to write into: after loading, each linear layer's
weight is repacked for oneDNN (or sgl-kernel) and the plain tensor dropped. So a push into
vLLM is always staged (``mode="staged"``): the boxes land in the transport's staging memory and
are checksummed there (``verify``); the commit writes them, layer by layer, into the layers'
parameters in checkpoint format (in place where vLLM keeps them; made anew where it dropped
them) and has each layer's quantization method process them as vLLM's loader does (which
repacks). Then every box is checked where vLLM computes with it, through every layer that holds
it: a plain parameter by its CRC32 against the one its trainer rank read, a repacked weight by
columns read back through the layer's own matmul (`SAMPLED_COLUMNS` per weight, every output
row, bit for bit against the landed box; reading all of it back would cost a matmul by the
identity, K times the weight's FLOPs). A fused-MoE layer's experts, which the CPU build keeps
padded and prepacked for its grouped GEMM (and does not prepack again on a weight update), are
written in checkpoint format and prepacked by vLLM's own kernel code at commit, then compared
whole, byte for byte, with the landed boxes prepacked anew.

vLLM's own ``reload_weights`` (its layer-by-layer reload, which the RL frameworks' path and the
baseline of `tandem bench sync --into vllm` use) does the same from full checkpoint tensors,
restoring each layer on the meta device, buffering, materializing and copying again; it also
leaves an LM head tied to the embedding computing with its old repacked copy.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from vllm.config import set_current_vllm_config

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import tensor_crc32
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import (
    WeightSyncError,
    crc_problems,
    hold_landed,
    record_problems,
)
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.exchange.transports import TRANSPORTS
from tandem.exchange.transports.base import ReceiverHalf
from tandem.integrations.vllm.messages import PhaseReply

SAMPLED_COLUMNS = 16  # of each repacked weight, read back through vLLM's matmul per push
READ_COLUMNS = 256  # of a repacked weight per matmul, when a worker reads its weights whole
EXPERT_WEIGHTS = ("w13_weight", "w2_weight")  # of a vLLM fused-MoE layer


class LocalShapes:
    """The worker's parameters in checkpoint format, as meta tensors: what a record is checked
    against before any byte is read (`record_problems` needs names, shapes and the dtype)."""

    def __init__(self, layout: RankLayout, dtype: torch.dtype):
        self._params = {
            key: torch.empty(shape, dtype=dtype, device="meta")
            for key, shape in layout.local_shapes.items()
        }

    def named_parameters(self):
        return self._params.items()


class VllmReceiver:
    """Kept by a worker across pushes (its transports' halves with their mappings)."""

    def __init__(self, model: nn.Module, layout: RankLayout, vllm_config, device: torch.device):
        self.model = model
        self.layout = layout
        self.vllm_config = vllm_config  # the worker's (vLLM's processing reads it)
        self.device = device
        self.dtype = DTYPES[layout.dtype]
        self.shapes = LocalShapes(layout, self.dtype)
        self._halves: dict[str, ReceiverHalf] = {}
        self.users = _users(model, list(layout.local_shapes))
        self.expert_keys = {
            key for key, users in self.users.items() if _prepacked_experts(users[0][1]) is not None
        }
        # a rolling push's boxes, held by this worker until its wave commits: (version, boxes)
        self._held: tuple[int, list[torch.Tensor]] | None = None

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
            if phase is PushPhase.HOLD:
                return self._reply(half, spec, self._hold(half, spec, records), 0)
            if phase is PushPhase.COMMIT:
                held, self._held = self._held, None
                from_held = held is not None and held[0] == spec.version
                boxes = held[1] if from_held else half.landed(spec, records)
                torn = True  # from here vLLM's live weights change
                nbytes = self._load(records, boxes)
                problems = self.check_live(records, boxes) if spec.settings.verify else []
                if not from_held:  # the held copy's staging was released at hold
                    half.release(spec)
                return self._reply(half, spec, problems, nbytes, torn=bool(problems))
            self._held = None
            half.abort(spec)
            return PhaseReply(None, 0)
        except Exception as exc:
            return self._reply(half, spec, [f"{type(exc).__name__}: {exc}"], 0, torn=torn)

    def _hold(self, half: ReceiverHalf, spec: UpdateSpec, records: list[Record]) -> list[str]:
        """A rolling push, verified: held in this worker's memory (`hold_landed`); vLLM serves
        the old weights until the wave's commit loads the copies."""
        self._held = None
        problems, held = hold_landed(half, spec, records, self.device)
        if not problems:
            self._held = (spec.version, held)
        return problems

    def _reply(
        self,
        half: ReceiverHalf,
        spec: UpdateSpec,
        problems: list[str],
        nbytes: int,
        torn: bool = False,
    ) -> PhaseReply:
        if not problems:
            return PhaseReply(None, nbytes)
        try:
            half.abort(spec)
        except Exception:  # the push already failed; nothing more to report
            pass
        return PhaseReply("; ".join(problems), nbytes, torn)

    def _half(self, name: str) -> ReceiverHalf:
        if name not in self._halves:
            self._halves[name] = TRANSPORTS[name].receiver(
                self.shapes, self.layout.rank, self.device
            )
        return self._halves[name]

    def _load(self, records: list[Record], boxes: list[torch.Tensor]) -> int:
        """The landed boxes into vLLM's live layers, one layer at a time: each box into its
        region of the parameter (`Record.region`, from the layout table), in place where vLLM
        keeps the plain tensor (norms, biases, the embedding); where vLLM's CPU build dropped
        it after repacking (linear weights) into the layer's parameter made anew in checkpoint
        format. Then the layer's quantization method processes it as vLLM's loader does after
        loading (``process_weights_after_loading``: the CPU build repacks for oneDNN, dropping
        the plain weight again), as does every other layer sharing one of its tensors (an LM
        head tied to the embedding)."""
        by_module: dict[str, dict[str, list[tuple[Record, torch.Tensor]]]] = defaultdict(dict)
        for r, box in zip(records, boxes, strict=True):
            module_name, _, attr = r.key.rpartition(".")
            by_module[module_name].setdefault(attr, []).append((r, box))
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            for module_name, attrs in by_module.items():
                module = self.model.get_submodule(module_name)
                if _prepacked_experts(module) is not None:  # written as vLLM prepacks them
                    for attr, packed in self._packed_experts(module_name, attrs).items():
                        getattr(module, attr).copy_(packed)
                    continue
                for attr, items in attrs.items():
                    shape = tuple(self.layout.local_shapes[f"{module_name}.{attr}"])
                    live = getattr(module, attr)
                    if tuple(live.shape) != shape:  # repacked: its checkpoint form, anew
                        covered = sum(box.numel() for _, box in items) == math.prod(shape)
                        make = torch.empty if covered else torch.zeros
                        live = make(shape, dtype=self.dtype, device=self.device)
                        setattr(module, attr, nn.Parameter(live, requires_grad=False))
                    for r, box in items:
                        r.region.view(live).copy_(box)
                owners = {
                    id(m): m for attr in attrs for _, m, _ in self.users[f"{module_name}.{attr}"]
                }
                for owner in owners.values():
                    method = getattr(owner, "quant_method", None)
                    if method is not None:
                        method.process_weights_after_loading(owner)
        return sum(r.nbytes for r in records)

    def check_live(self, records: list[Record], boxes: list[torch.Tensor]) -> list[str]:
        """Every record's box as vLLM now computes with it, each way a layer uses it: a plain
        parameter by the CRC32 its trainer rank read; a weight a layer multiplies by through
        that layer's matmul on `SAMPLED_COLUMNS` one-hot inputs (a column each, every output
        row), bit for bit against the same columns of the landed box, which matched its
        trainer's CRC32 in the verify phase."""
        problems = self._check_experts(records, boxes)
        cache: dict[str, list[tuple[str, torch.Tensor, torch.Tensor | None]]] = {}
        for r, box in zip(records, boxes, strict=True):
            if r.key in self.expert_keys:
                continue
            if r.key not in cache:
                shape = tuple(self.layout.local_shapes[r.key])
                reads = [
                    _read_back(*user, shape, self.dtype, self.device) for user in self.users[r.key]
                ]
                cache[r.key] = [view for views in reads for view in views]
            for how, tensor, columns in cache[r.key]:
                if columns is None:
                    if r.crc is not None and tensor_crc32(r.region.view(tensor)) != r.crc:
                        problems.append(
                            f"checksum mismatch for {r.where} in vLLM's live "
                            f"weights after commit ({how})"
                        )
                    continue
                (r0, r1), (c0, c1) = r.region.slices
                inside = (columns >= c0) & (columns < c1)
                got = tensor[r0:r1, inside.nonzero().flatten()]
                if not torch.equal(got, box[:, columns[inside] - c0]):
                    problems.append(
                        f"{r.where} differs in vLLM's live weights after commit "
                        f"({how}, sampled columns)"
                    )
        return problems

    @torch.no_grad()
    def read_weights(self) -> dict[str, torch.Tensor]:
        """This worker's parameters as the layout's local tensors (checkpoint format), for a
        push of its weights into another replica: a plain parameter as vLLM keeps it, a
        repacked linear weight read back whole through the layer's own matmul (exact: one
        product per element; it costs a forward of as many tokens as the weight has
        columns). A fused-MoE layer's prepacked experts cannot be read back: refused."""
        if self.expert_keys:
            raise WeightSyncError(
                f"this vLLM worker keeps {sorted(self.expert_keys)[0]} (and every fused-MoE "
                "expert weight) prepacked for its CPU kernel: it cannot send its weights to "
                "a peer; push into it from the trainer"
            )
        tensors = {}
        for key, shape in self.layout.local_shapes.items():
            name, module, attr = self.users[key][0]
            param = getattr(module, attr)
            if tuple(param.shape) == tuple(shape):
                tensors[key] = param.detach()
            elif _is_linear(module) and attr == "weight" and len(shape) == 2:
                tensors[key] = _read_whole(module, tuple(shape), self.dtype, self.device)
            else:
                raise WeightSyncError(
                    f"{key}: vLLM holds shape {tuple(param.shape)}, the layout table says "
                    f"{tuple(shape)}, and {name} is no linear layer to read it back through"
                )
        return tensors

    def _packed_experts(self, module_name: str, attrs: dict[str, list]) -> dict:
        """A fused-MoE layer's expert weights (``w13_weight``, ``w2_weight``) as vLLM's CPU
        kernel holds them, made from ``attrs``' boxes: written into their checkpoint format
        ([E, 2 I/tp, H] and [E, H, I/tp]), then padded and prepacked by vLLM's own kernel
        code, as it did at load (it does not prepack again on a weight update)."""
        module = self.model.get_submodule(module_name)
        scratch = nn.Module()
        for attr in EXPERT_WEIGHTS:
            if attr not in attrs:
                raise ValueError(
                    f"{module_name}: a push carries both expert weights "
                    f"{EXPERT_WEIGHTS}, got {sorted(attrs)}"
                )
            shape = self.layout.local_shapes[f"{module_name}.{attr}"]
            flat = torch.zeros(shape, dtype=self.dtype, device=self.device)
            for r, box in attrs[attr]:
                r.region.view(flat).copy_(box)
            experts = getattr(module, attr).shape[0]
            grouped = flat.view(experts, shape[0] // experts, shape[1])
            scratch.register_parameter(attr, nn.Parameter(grouped, requires_grad=False))
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            _prepacked_experts(module).process_weights_after_loading(scratch)
        return {attr: getattr(scratch, attr) for attr in EXPERT_WEIGHTS}

    def _check_experts(self, records: list[Record], boxes: list[torch.Tensor]) -> list[str]:
        """Every fused-MoE layer's expert weights as vLLM now computes with them, bit for bit
        against the landed boxes prepacked anew (the whole tensor: a copy, not a matmul)."""
        by_module: dict[str, dict[str, list]] = defaultdict(dict)
        for r, box in zip(records, boxes, strict=True):
            if r.key in self.expert_keys:
                module_name, _, attr = r.key.rpartition(".")
                by_module[module_name].setdefault(attr, []).append((r, box))
        problems = []
        for module_name, attrs in by_module.items():
            module = self.model.get_submodule(module_name)
            for attr, expected in self._packed_experts(module_name, attrs).items():
                if not torch.equal(getattr(module, attr), expected):
                    problems.append(
                        f"{module_name}.{attr} differs in vLLM's live weights after "
                        f"commit (its prepacked experts)"
                    )
        return problems


def _prepacked_experts(module: nn.Module):
    """The CPU experts kernel of a vLLM fused-MoE layer (which prepacked its expert weights),
    or None for any other module."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    if not isinstance(module, RoutedExperts):
        return None
    return module.quant_method.moe_kernel.fused_experts


def _users(model: nn.Module, keys: list[str]) -> dict[str, list[tuple[str, nn.Module, str]]]:
    """For each parameter, every (module name, module, attribute) holding it: the module its
    name points at first, then any other a tied tensor is shared with (an LM head tied to the
    token embedding, which keeps a repacked copy of its own). A module reached by two paths
    (a MoE layer's router, which its experts' runner holds too) counts once, by its first."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = defaultdict(list)
    seen: set[tuple[int, int, str]] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            if (id(param), id(module), attr) not in seen:
                seen.add((id(param), id(module), attr))
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
) -> list:
    """A parameter of ``module`` in checkpoint format, every way the module's forward uses it,
    as (how, tensor, sampled columns or None): the plain parameter where vLLM keeps it (norms,
    biases, the token embedding), and, for a 2-D weight the module multiplies by (linear
    layers, whose plain weight vLLM's CPU build drops after repacking; the LM head, or the
    embedding's own matmul), the module's matmul on one-hot rows: columns of the weight, read
    back exactly (one product each)."""
    views = []
    param = getattr(module, attr)
    if tuple(param.shape) == shape:
        views.append((f"tensor in {name}", param, None))
    elif not _is_linear(module):
        raise ValueError(
            f"{name}.{attr}: vLLM holds shape {tuple(param.shape)}, the layout table says {shape}"
        )
    apply = getattr(getattr(module, "quant_method", None), "apply", None)
    if attr == "weight" and len(shape) == 2 and apply is not None:
        columns = _sampled(shape[1])
        one_hot = torch.zeros(len(columns), shape[1], dtype=dtype, device=device)
        one_hot[torch.arange(len(columns)), columns] = 1
        views.append((f"matmul in {name}", apply(module, one_hot, None).t()[: shape[0]], columns))
    return views


def _read_whole(
    module: nn.Module, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A linear layer's weight in checkpoint format, ``shape`` (out, in), read back through its
    matmul on one-hot rows, `READ_COLUMNS` columns at a time (no bias: ``apply``'s None)."""
    out, columns = shape
    weight = torch.empty(shape, dtype=dtype, device=device)
    for c0 in range(0, columns, READ_COLUMNS):
        n = min(READ_COLUMNS, columns - c0)
        one_hot = torch.zeros(n, columns, dtype=dtype, device=device)
        one_hot[torch.arange(n), torch.arange(c0, c0 + n)] = 1
        weight[:, c0 : c0 + n] = module.quant_method.apply(module, one_hot, None).t()[:out]
    return weight


def _sampled(n: int) -> torch.Tensor:
    """`SAMPLED_COLUMNS` of ``n`` columns, the first and last among them, drawn afresh each
    push (a fault cannot hide in the columns that are never read)."""
    if n <= SAMPLED_COLUMNS:
        return torch.arange(n)
    middle = torch.randperm(n - 2)[: SAMPLED_COLUMNS - 2] + 1
    return torch.cat([torch.tensor([0]), middle.sort().values, torch.tensor([n - 1])])


def _is_linear(module: nn.Module) -> bool:
    """A vLLM linear layer (its CPU build may drop the plain weight after repacking it)."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase)

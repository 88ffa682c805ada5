"""Trainer and fleet layouts from metadata alone, as the planner takes them.

The fleet's layouts are the engine's own: its model class built on the meta device for each
(pipeline stage, tensor-parallel rank), replicated per replica (one regions list shared by
every replica's rank j). The trainers' are placement rules over the canonical tensors:

- FSDP2 (transformers model, ``fully_shard``): every tensor ``Shard(0)`` over the ranks, as
  `torch.chunk` cuts it; a MoE layer's experts are one grouped tensor per projection
  ([E, 2I, H], [E, H, I]), so a rank holds whole experts of its chunk of E.
- Megatron-core (ranks ordered tp, then dp with ep inside it, then pp): layers split over pp
  stages as evenly as possible (embedding on the first, final norm and output layer on the
  last); q/k/v and dense gate/up split by rows over tp, o and down by columns, vocabulary rows
  over tp (padded to 128 x tp); kv heads fewer than tp are replicated; experts whole, a
  contiguous E / ep on each expert-parallel rank (expert tp 1); norms and routers whole;
  every data-parallel copy holds the same boxes (the planner spreads reads over them).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from torch.distributed.tensor import Shard

from tandem.exchange.adapters import engine_layout, shard_box
from tandem.exchange.layout import RankLayout
from tandem.layers.placement import Piece
from tandem.models.loader import ModelSpec
from tandem.models.stages import prune_to_stage, split_layers
from tandem.parallel import ParallelDims
from tandem.scale.cluster import parse_number, parse_pairs
from tandem.scale.shapes import meta_model

Box = tuple[tuple[int, int], ...]
_EXPERT = re.compile(r"^(model\.layers\.\d+\..+\.experts)\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class TrainerSpec:
    kind: str  # "fsdp" | "megatron"
    ranks: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.kind not in ("fsdp", "megatron"):
            raise ValueError(f"trainer: kind must be 'fsdp' or 'megatron', got {self.kind!r}")
        for name in ("ranks", "tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.ranks % (self.tp * self.pp):
            raise ValueError(
                f"trainer.ranks ({self.ranks}) is not a multiple of tp x pp ({self.tp * self.pp})"
            )
        if (self.tp * self.dp) % self.ep:
            raise ValueError(
                f"trainer.ep ({self.ep}) must divide tp x dp ({self.tp * self.dp}): expert "
                "parallelism is carved out of a stage's ranks"
            )
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"trainer.dtype must be bfloat16, float32 or float16: {self.dtype!r}")

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @classmethod
    def parse(cls, text: str) -> TrainerSpec:
        """``fsdp:ranks=256`` or ``megatron:tp=1,pp=8,ep=64,dp=64`` (``ranks`` or ``dp``)."""
        kind, _, rest = text.partition(":")
        pairs = parse_pairs(rest, "trainer")
        allowed = {
            "fsdp": {"ranks", "dtype"},
            "megatron": {"ranks", "tp", "pp", "ep", "dp", "dtype"},
        }.get(kind)
        if allowed is None:
            raise ValueError(f"trainer: kind must be 'fsdp' or 'megatron', got {kind!r}")
        extra = sorted(set(pairs) - allowed)
        if extra:
            raise ValueError(f"trainer.{extra[0]}: unknown for {kind}; known: {sorted(allowed)}")
        dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(
            pairs.get("dtype", "bf16"), pairs.get("dtype")
        )
        nums = {k: _count(v, f"trainer.{k}") for k, v in pairs.items() if k != "dtype"}
        tp, pp = nums.get("tp", 1), nums.get("pp", 1)
        if "dp" in nums:
            ranks = tp * pp * nums["dp"]
            if nums.get("ranks", ranks) != ranks:
                raise ValueError(f"trainer.ranks ({nums['ranks']}) != tp x pp x dp ({ranks})")
        elif "ranks" in nums:
            ranks = nums["ranks"]
        else:
            raise ValueError("trainer.ranks: give ranks=N (or, for megatron, dp=N)")
        return cls(kind, ranks, tp, pp, nums.get("ep", 1), dtype)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    replicas: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("replicas", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"fleet.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.pp

    @classmethod
    def parse(cls, text: str) -> FleetSpec:
        """``replicas=8,tp=16[,pp=1][,ep=16]``: tandem's engine places experts over its
        tensor-parallel group, so ``ep`` may only restate ``tp``."""
        nums = {k: _count(v, f"fleet.{k}") for k, v in parse_pairs(text, "fleet").items()}
        extra = sorted(set(nums) - {"replicas", "tp", "pp", "ep"})
        if extra:
            raise ValueError(f"fleet.{extra[0]}: unknown; known: ['ep', 'pp', 'replicas', 'tp']")
        if "replicas" not in nums:
            raise ValueError("fleet.replicas: missing (replicas=R)")
        ep = nums.pop("ep", nums.get("tp", 1))
        if ep != nums.get("tp", 1):
            raise ValueError(
                f"fleet.ep ({ep}) must equal fleet.tp ({nums.get('tp', 1)}): tandem's engine "
                "holds whole experts spread over its tensor-parallel group"
            )
        return cls(**nums)


def _count(value: str, field: str) -> int:
    number = parse_number(value, field)
    if not isinstance(number, int):
        raise ValueError(f"{field}: expected a whole number, got {value!r}")
    return number


def fleet_layouts(spec: ModelSpec, fleet: FleetSpec, dtype: str) -> list[RankLayout]:
    """Every engine rank of every replica, numbered replica x ranks_per_replica + local rank."""
    dims = ParallelDims(fleet.tp, fleet.pp)
    stages = split_layers(spec.num_layers, fleet.pp)
    local: list[RankLayout] = []
    for stage in stages:
        for tp_rank in range(fleet.tp):
            model = meta_model(spec, tp_rank, fleet.tp)
            prune_to_stage(model, stage)
            local.append(engine_layout(model, dims.rank(stage.index, tp_rank)))
    per = fleet.ranks_per_replica
    return [
        RankLayout(r * per + j, lay.regions, lay.local_shapes, dtype, replica=r)
        for r in range(fleet.replicas)
        for j, lay in enumerate(local)
    ]


def canonical_shapes(layouts: list[RankLayout]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    seen = set()
    for layout in layouts:
        if id(layout.regions) in seen:
            continue
        seen.add(id(layout.regions))
        shapes.update(layout.canonical_shapes())
    return shapes


def trainer_layouts(
    spec: ModelSpec, trainer: TrainerSpec, shapes: dict[str, tuple[int, ...]]
) -> list[RankLayout]:
    """What each trainer rank holds of the canonical tensors ``shapes``."""
    layouts = [RankLayout(r, dtype=trainer.dtype) for r in range(trainer.ranks)]
    rules = _Fsdp(trainer) if trainer.kind == "fsdp" else _Megatron(spec, trainer)
    problems = []
    for name, shape in shapes.items():
        if _EXPERT.match(name):
            continue
        try:
            for rank, box in rules.place(name, shape):
                _add(layouts[rank], name, shape, box)
        except KeyError:
            problems.append(name)
    if problems:
        raise ValueError(
            f"trainer: no {trainer.kind} placement rule for {len(problems)} tensor(s), e.g. "
            f"{problems[:5]}"
        )
    for prefix, per_expert in _experts(shapes).items():
        count = max(per_expert) + 1
        for rank, e in rules.experts(prefix, count):
            for name in per_expert[e]:
                _add(layouts[rank], name, shapes[name], tuple((0, n) for n in shapes[name]))
    return layouts


def _add(layout: RankLayout, name: str, shape: tuple[int, ...], box: Box) -> None:
    local = tuple(b - a for a, b in box)
    layout.add(name, local, [Piece(name, shape, box, (0,) * len(shape))])


def _experts(shapes) -> dict[str, dict[int, list[str]]]:
    """{a MoE layer's experts prefix: {expert: its tensor names}}."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for name in shapes:
        if m := _EXPERT.match(name):
            out[m.group(1)][int(m.group(2))].append(name)
    return out


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``size`` in ``parts`` (empty past the end)."""
    ((lo, hi),) = shard_box((size,), [Shard(0)], (parts,), (index,))
    return lo, hi


class _Fsdp:
    def __init__(self, trainer: TrainerSpec):
        self.ranks = trainer.ranks

    def place(self, name: str, shape: tuple[int, ...]):
        for rank in range(self.ranks):
            lo, hi = _chunk(shape[0], self.ranks, rank)
            if lo < hi:
                yield rank, ((lo, hi), *((0, n) for n in shape[1:]))

    def experts(self, prefix: str, count: int):
        for rank in range(self.ranks):
            for e in range(*_chunk(count, self.ranks, rank)):
                yield rank, e


class _Megatron:
    _ROWS = (
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    )
    _KV = (
        "self_attn.k_proj.weight",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
    )
    _COLS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    _WHOLE = (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.o_proj.bias",
        "mlp.down_proj.bias",
        "mlp.gate.weight",
    )

    def __init__(self, spec: ModelSpec, trainer: TrainerSpec):
        self.t = trainer
        self.stages = split_layers(spec.num_layers, trainer.pp)
        self.kv_heads = getattr(spec.config, "kv_heads", None)
        self.head_dim = getattr(spec.config, "dim_per_head", None)

    def _copies(self, stage: int, tp_rank: int):
        """Global ranks holding tp rank ``tp_rank``'s part on pipeline stage ``stage``."""
        base = stage * self.t.tp * self.t.dp
        return (base + d * self.t.tp + tp_rank for d in range(self.t.dp))

    def _stage(self, layer: int) -> int:
        return next(s.index for s in self.stages if s.start <= layer < s.end)

    def place(self, name: str, shape: tuple[int, ...]):
        tp = self.t.tp
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            stage = 0 if name.startswith("model.") else self.t.pp - 1
            padded = -(-shape[0] // (128 * tp)) * 128 * tp
            per = padded // tp
            for r in range(tp):
                lo, hi = r * per, min((r + 1) * per, shape[0])
                if lo < hi:
                    yield from ((g, ((lo, hi), (0, shape[1]))) for g in self._copies(stage, r))
            return
        if name == "model.norm.weight":
            for r in range(tp):
                yield from ((g, ((0, shape[0]),)) for g in self._copies(self.t.pp - 1, r))
            return
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(name)
        stage, rest = self._stage(int(m.group(1))), name[m.end() :]
        full = tuple((0, n) for n in shape)
        for r in range(tp):
            if rest in self._ROWS:
                box = (_even(shape[0], tp, r, name), *full[1:])
            elif rest in self._KV:
                box = (self._kv_rows(shape[0], r, name), *full[1:])
            elif rest in self._COLS:
                box = (full[0], _even(shape[1], tp, r, name))
            elif rest in self._WHOLE:
                box = full
            else:
                raise KeyError(name)
            yield from ((g, box) for g in self._copies(stage, r))

    def _kv_rows(self, rows: int, tp_rank: int, name: str) -> tuple[int, int]:
        if self.kv_heads is None or self.kv_heads >= self.t.tp:
            return _even(rows, self.t.tp, tp_rank, name)
        head = tp_rank * self.kv_heads // self.t.tp  # fewer kv heads than tp: replicated
        return head * self.head_dim, (head + 1) * self.head_dim

    def experts(self, prefix: str, count: int):
        if count % self.t.ep:
            raise ValueError(f"trainer.ep ({self.t.ep}) does not divide {prefix}'s {count} experts")
        stage = self._stage(int(_LAYER.match(prefix).group(1)))
        per_rank = count // self.t.ep
        base = stage * self.t.tp * self.t.dp
        for e in range(count):
            for copy in range(self.t.tp * self.t.dp // self.t.ep):
                yield base + copy * self.t.ep + e // per_rank, e


def _even(size: int, parts: int, index: int, name: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(f"trainer.tp ({parts}) does not divide {name}'s {size}")
    per = size // parts
    return index * per, (index + 1) * per

"""Layout descriptions: which boxes of which canonical tensors each rank holds, and where.

A canonical tensor is a Hugging Face name with its full shape. A rank's local tensor is described
by pieces (`tandem.layers.placement.Piece`): "this region of local tensor K is that box of
canonical tensor X". A fused local tensor (qkv, gate_up, Megatron's grouped qkv) is several
pieces; nothing is ever gathered to be converted. Layouts are plain data: they cross processes
inside typed messages (`tandem.wire.Codec`) and are all the planner sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.layers.lora import LoraSite
from tandem.layers.placement import Piece


@dataclass(frozen=True, slots=True)
class Region:
    """One piece of one local tensor of a rank."""

    key: str  # the local tensor's name on its rank
    piece: Piece


@dataclass(slots=True)
class RankLayout:
    """Everything one rank holds (sender or receiver side)."""

    rank: int
    regions: list[Region] = field(default_factory=list)
    local_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtype: str = "float32"  # of its local tensors
    arena: list | None = None  # engine ranks on CPU: `ParamArena.handle()` (shm in_place)
    replica: int = 0  # receiving ranks: which replica of a fleet holds this rank
    dtypes: dict[str, str] = field(default_factory=dict)  # local tensors not in ``dtype``
    # receiving ranks: canonical weights held as block-FP8, with their scale block
    fp8_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)
    # receiving ranks serving LoRA: their adapter sites (`tandem.layers.lora`)
    lora_sites: list[LoraSite] = field(default_factory=list)

    def add(self, key: str, local_shape: tuple[int, ...], pieces: list[Piece]) -> None:
        self.local_shapes[key] = tuple(local_shape)
        self.regions.extend(Region(key, p) for p in pieces)

    def dtype_of(self, key: str) -> str:
        return self.dtypes.get(key, self.dtype)

    def canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        return {r.piece.name: r.piece.full_shape for r in self.regions}


class LayoutMismatch(ValueError):
    """Sender and receiver layouts disagree; every problem is listed at once."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "; ".join(problems[:20])
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} layout problem(s): {shown}{more}")


def layout_problems(
    senders: list[RankLayout], receivers: list[RankLayout], ignore: frozenset[str] = frozenset()
) -> list[str]:
    """Every disagreement between the two sides, by name: a tensor receivers need that no sender
    has, a tensor senders have that receivers do not know (unless in ``ignore``), and full shapes
    that differ across or within a side."""
    problems: list[str] = []
    have = _shapes(senders, "senders", problems)
    need = _shapes(receivers, "receivers", problems)
    for name, shape in sorted(need.items()):
        if name not in have:
            problems.append(f"receivers need {name} {shape}, no sender has it")
        elif have[name] != shape:
            problems.append(f"{name}: senders have shape {have[name]}, receivers {shape}")
    for name in sorted(set(have) - set(need) - ignore):
        problems.append(f"senders have {name}, which the receivers do not know")
    return problems


def _shapes(layouts: list[RankLayout], side: str, problems: list[str]) -> dict:
    shapes: dict[str, tuple[int, ...]] = {}
    for layout in layouts:
        for name, shape in layout.canonical_shapes().items():
            if shapes.setdefault(name, shape) != shape:
                problems.append(f"{name}: {side} disagree on its shape ({shapes[name]} vs {shape})")
    return shapes

"""Bytes a push puts on the wire per box, by the engine's dtype.

bf16/float32 engines take every element at their width. A block-FP8 engine (DeepSeek-V3 /
Qwen3-FP8 checkpoints: ``quant_method "fp8"``, e4m3, 128 x 128 blocks) holds the 2-D weights of
its decoder layers' linear layers as one byte per weight plus one float32 scale per block of
the box; embeddings, the output layer, routers and norms stay bf16. The trainer quantizes, so
the wire carries the FP8 bytes.

With ``delta_density`` (a delta push, `tandem.exchange.delta`: that fraction of each box's
elements changed), a box carries the smallest of its dense, bitmap and indices payloads at
its width, the changed count spread evenly over boxes (an FP8 box's scales go whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.exchange.delta import sizes
from tandem.exchange.plan import numel

BLOCK = 128
ENGINE_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp8": "fp8",
    "float32": "float32",
    "fp32": "float32",
}
WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(slots=True)
class WireFormat:
    engine_dtype: str  # "bfloat16" | "float32" | "fp8"
    delta_density: float | None = None  # a delta push: the fraction of elements changed
    _fp8: dict[str, bool] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        density = self.delta_density
        if density is not None and not (isinstance(density, int | float) and 0 <= density <= 1):
            raise ValueError(f"delta_density must be a number in [0, 1], got {density!r}")
        dtype = ENGINE_DTYPES.get(self.engine_dtype)
        if dtype is None:
            raise ValueError(
                f"engine_dtype must be one of {sorted(ENGINE_DTYPES)}, got {self.engine_dtype!r}"
            )
        self.engine_dtype = dtype

    def is_fp8(self, name: str, full_shape: tuple[int, ...]) -> bool:
        known = self._fp8.get(name)
        if known is None:
            known = self._fp8[name] = (
                self.engine_dtype == "fp8"
                and len(full_shape) == 2
                and name.startswith("model.layers.")
                and name.endswith(".weight")
                and not name.endswith(".gate.weight")  # the MoE router
            )
        return known

    def box_bytes(self, name: str, full_shape: tuple[int, ...], box) -> int:
        count = numel(box)
        if self.is_fp8(name, full_shape):
            (r0, r1), (c0, c1) = box
            blocks = (r1 // BLOCK - r0 // BLOCK + (r1 % BLOCK > 0)) * (
                c1 // BLOCK - c0 // BLOCK + (c1 % BLOCK > 0)
            )
            return self._payload(count, 1) + 4 * blocks
        return self._payload(count, WIDTH.get(self.engine_dtype, 2))

    def _payload(self, count: int, width: int) -> int:
        if self.delta_density is None:
            return count * width
        return min(sizes(count, round(count * self.delta_density), width).values())

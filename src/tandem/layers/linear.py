"""Tensor-parallel linear layers. Each parameter declares which canonical boxes it holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.fp8 import FP8, Fp8Weight, fp8_placement
from tandem.layers.gemm import PackedWeight, linear
from tandem.layers.placement import Piece, cols, rows, set_pieces, whole
from tandem.parallel import SINGLE, TPGroup


@dataclass(frozen=True, slots=True)
class Section:
    """``size`` output features of canonical ``weight`` (and ``bias``), starting at canonical
    row ``start`` of a tensor with ``total`` rows (default: the section is the whole tensor)."""

    weight: str
    bias: str | None
    size: int
    start: int = 0
    total: int | None = None


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """What the parallel linear layers share: the matmul on the live weight, dense or
    block-FP8 (`to_fp8`: e4m3 values beside their block scales ``weight_scale_inv``, placed
    with the weight; computed on the weight dequantized to the input's dtype)."""

    weight: nn.Parameter
    packed: PackedWeight | None
    fp8: Fp8Weight | None = None

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the weight as block-FP8 (before the parameters get storage: on meta)."""
        pieces = self.weight.pieces
        placement = fp8_placement(pieces, tuple(self.weight.shape), block)
        weight = nn.Parameter(torch.empty(self.weight.shape, dtype=FP8), requires_grad=False)
        scales = nn.Parameter(torch.empty(placement.shape), requires_grad=False)
        weight.pieces, weight.keeps_dtype = pieces, True
        scales.pieces, scales.keeps_dtype = placement.pieces, True
        self.weight, self.weight_scale_inv = weight, scales
        self.fp8 = Fp8Weight(placement, block)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if self.fp8 is None else self._dequantized(x.dtype)
        return linear(x, weight, bias, self.packed)

    def with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this layer's output for ``x``) plus each row's adapter delta, where the
        engine serves LoRA (a ``lora`` submodule: `tandem.layers.lora.LoRAStack`)."""
        lora = self._modules.get("lora")
        return y if lora is None else lora(x, y)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 weight in ``dtype``: kept with the packed copy until the values or scales
        change, or made every call where the layer keeps no packed copy (FP8 memory only)."""
        values, scales = self.weight, self.weight_scale_inv
        if self.packed is None:
            return self.fp8.dequantize(values, scales, dtype)
        return self.packed.source(
            (values, scales, dtype), lambda: self.fp8.dequantize(values, scales, dtype)
        )


def fp8_blocks(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The canonical weights ``model`` holds as block-FP8, with their scale block."""
    return {
        p.name: layer.fp8.block
        for layer in model.modules()
        if isinstance(layer, LinearBase) and layer.fp8 is not None
        for p in layer.weight.pieces
    }


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's output rows split across ranks; outputs stay sharded.

    ``outputs`` lists the sections stacked along the output dim. One section is a plain
    linear; several make a fused layer (gate_up, GPT-2's c_attn) whose local rows are each
    section's shard in turn: [gate_r; up_r].
    """

    def __init__(
        self,
        in_features: int,
        outputs: list[Section],
        tp: TPGroup = SINGLE,
        *,
        conv1d: bool = False,
    ):
        super().__init__()
        self.tp = tp
        out_local = [_divide(s.size, tp.size, s.weight) for s in outputs]
        self.weight = _empty(sum(out_local), in_features)
        has_bias = [s.bias is not None for s in outputs]
        if any(has_bias) and not all(has_bias):
            raise ValueError(f"fused outputs {[s.weight for s in outputs]} mix bias and no bias")
        self.bias = _empty(sum(out_local)) if all(has_bias) else None
        self.packed = PackedWeight()
        w_pieces, b_pieces, at = [], [], 0
        for sec, local in zip(outputs, out_local, strict=True):
            start = sec.start + tp.rank * local
            total = sec.total or sec.size
            if conv1d:
                w_pieces.append(_conv1d_cols(sec.weight, (in_features, total), start, local, at))
            else:
                w_pieces.append(rows(sec.weight, (total, in_features), start, start + local, at))
            if sec.bias is not None:
                b_pieces.append(rows(sec.bias, (total,), start, start + local, at))
            at += local
        set_pieces(self.weight, w_pieces)
        if self.bias is not None:
            set_pieces(self.bias, b_pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_lora(x, self.matmul(x, self.bias))


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection: heads split across ranks; kv heads replicated if fewer than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        names: tuple[str, str, str],
        *,
        bias: bool,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        self.tp = tp
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            kv_first = tp.rank * self.num_kv_heads
        elif tp.size % num_kv_heads == 0:
            self.num_kv_heads = 1
            kv_first = tp.rank * num_kv_heads // tp.size
        else:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) must divide or be a multiple of "
                f"tensor_parallel_size ({tp.size})"
            )
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = self.q_size + 2 * self.kv_size
        self.weight = _empty(out, hidden_size)
        self.bias = _empty(out) if bias else None
        self.packed = PackedWeight()
        sections = [
            (names[0], num_heads * head_dim, tp.rank * self.q_size, self.q_size, 0),
            (names[1], num_kv_heads * head_dim, kv_first * head_dim, self.kv_size, self.q_size),
            (names[2], num_kv_heads * head_dim, kv_first * head_dim, self.kv_size,
             self.q_size + self.kv_size),
        ]  # fmt: skip
        set_pieces(
            self.weight,
            [
                rows(f"{n}.weight", (full, hidden_size), s, s + k, at)
                for n, full, s, k, at in sections
            ],
        )
        if self.bias is not None:
            set_pieces(
                self.bias,
                [rows(f"{n}.bias", (full,), s, s + k, at) for n, full, s, k, at in sections],
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.with_lora(x, self.matmul(x, self.bias))
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight_name: str,
        bias_name: str | None,
        tp: TPGroup = SINGLE,
        *,
        conv1d: bool = False,
    ):
        super().__init__()
        self.tp = tp
        local = _divide(in_features, tp.size, f"{weight_name} input features")
        start = tp.rank * local
        self.weight = _empty(out_features, local)
        self.packed = PackedWeight()
        if conv1d:
            piece = _conv1d_rows(weight_name, (in_features, out_features), start, start + local)
        else:
            piece = cols(weight_name, (out_features, in_features), start, start + local)
        set_pieces(self.weight, [piece])
        self.bias = None
        if bias_name is not None:
            self.bias = set_pieces(_empty(out_features), [whole(bias_name, (out_features,))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.with_lora(x, self.matmul(x)))
        return y if self.bias is None else y + self.bias


def _conv1d_cols(name: str, full: tuple[int, int], start: int, size: int, at: int) -> Piece:
    """Output features [start, start+size) of an HF Conv1D weight ([in, out]) as local rows."""
    return Piece(name, full, ((0, full[0]), (start, start + size)), (at, 0), transposed=True)


def _conv1d_rows(name: str, full: tuple[int, int], start: int, stop: int) -> Piece:
    """Input features [start, stop) of an HF Conv1D weight as local columns."""
    return Piece(name, full, ((start, stop), (0, full[1])), (0, 0), transposed=True)

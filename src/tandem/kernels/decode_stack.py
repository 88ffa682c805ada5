"""A decode step of one to a few rows through a stack of Llama decoder layers, in one call
(`decode_stack.c`).

At one to four rows a decode step is a pass over the weights plus, per layer, a dozen small
ops; from Python each op costs a module call, its checks, an allocation and a ctypes call
(0.15-0.26 ms a layer on 2 cores: a quarter of a batch-1 step of a 30-layer model). The C loop
runs the same ops in the same order on the same kernels (`tandem.kernels.gemv`,
`tandem.kernels.pointwise`, `tandem.kernels.paged`, handed over by address), so a step's
hidden states, keys and values are the Python path's bit for bit. The models decide when it
serves (`LlamaForCausalLM.decode_layers`); no compiler, a failed build, one of those kernels
off, or ``TANDEM_DECODE_STACK=torch`` leaves the layers called one by one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels import gemv, paged, pointwise
from tandem.kernels.build import Library
from tandem.kernels.paged import PagedDecode

SOURCE = Path(__file__).with_name("decode_stack.c")
DTYPES = (torch.float32, torch.bfloat16)
LAYER = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")  # decode_stack.c
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _declare(dll: ctypes.CDLL) -> None:
    fn = dll.decode_stack
    fn.restype = _INT
    fn.argtypes = [_P, _P, _INT, _P, _F, _F, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P]


_library = Library(
    SOURCE, _declare, "TANDEM_DECODE_STACK", "decode stack loop", "Python's layer loop"
)


def available() -> bool:
    """Whether the loop and every kernel it calls serve this process."""
    return gemv.available() and pointwise.available() and paged.available() and _library.available()


@dataclass(frozen=True, slots=True)
class StackShape:
    """What every layer of the stack shares."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float  # both RMSNorms'
    scale: float  # attention's


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One layer's weights, live ([out, in]; the fused q/k/v rows as q, k, v and gate/up as
    gate, up), and its norms' weights."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


_entries: dict[torch.dtype, ctypes.Array] = {}


def _entry_points(dtype: torch.dtype) -> ctypes.Array:
    """The kernels the loop calls, in decode_stack.c's order."""
    if dtype not in _entries:
        _entries[dtype] = (ctypes.c_void_p * 7)(
            pointwise.entry("rms_norm", dtype),
            pointwise.entry("add_rms_norm", dtype),
            gemv.entry(dtype),
            pointwise.entry("rotary", dtype),
            pointwise.entry("scatter_rows", None),
            paged.entry(),
            pointwise.entry("silu_mul", dtype),
        )
    return _entries[dtype]


class DecodeStack:
    """A stack of layers of one shape and dtype, its weights checked once (their addresses are
    read at each step: a release and restore of the weights' memory may move them)."""

    def __init__(self, layers: list[StackLayer], shape: StackShape, hidden: int):
        if not layers:
            raise ValueError("a decode stack needs at least one layer")
        self.layers, self.shape, self.hidden = layers, shape, hidden
        self.dtype = layers[0].qkv.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"the stack's weights must be float32 or bfloat16, got {self.dtype}")
        h, kv, d, inter = shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
        want = {
            "input_norm": (hidden,),
            "qkv": ((h + 2 * kv) * d, hidden),
            "qkv_bias": ((h + 2 * kv) * d,),
            "o": (hidden, h * d),
            "post_norm": (hidden,),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter),
        }
        for i, layer in enumerate(layers):
            for name, size in want.items():
                t = getattr(layer, name)
                if t is None and name == "qkv_bias":
                    continue
                if t.dtype != self.dtype or t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(
                        f"layer {i}'s {name} must be a contiguous CPU {self.dtype} tensor"
                    )
                if tuple(t.shape) != size:
                    raise ValueError(f"layer {i}'s {name} has shape {tuple(t.shape)}, not {size}")
        self._tensors = [
            [getattr(layer, name) for name in LAYER] for layer in layers
        ]  # decode_stack.c's row order

    def run(
        self,
        x: torch.Tensor,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        rope: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        batch: PagedDecode,
    ) -> torch.Tensor:
        """The stack's output for the step's rows ``x`` [rows, hidden] (each row one decode
        token; rows may be strided): each layer as `LlamaDecoderLayer` computes it, its keys
        and values written into its ``caches`` (key, value: [slots, kv, head_dim] each) at
        ``slots`` [rows]. ``rope``: the step's rotary tables, [rows, 1, head_dim] each;
        ``batch``: paged decode attention's, every row in it."""
        rows, hidden = x.shape
        dtype, shape = self.dtype, self.shape
        if x.dtype != dtype or hidden != self.hidden or x.stride(1) != 1:
            raise ValueError(f"x must be [rows, {self.hidden}] {dtype} rows of unit stride")
        if not 1 <= rows <= gemv.MAX_ROWS:
            raise ValueError(f"the stack takes 1 to {gemv.MAX_ROWS} rows, got {rows}")
        if len(batch.rows) != rows or len(slots) != rows:
            raise ValueError(f"slots and the paged batch must hold each of the {rows} rows")
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError(f"slots must be contiguous int64, got {slots.dtype}")
        cos, sin = (t.reshape(rows, shape.head_dim) for t in rope)
        if not (cos.dtype == sin.dtype == dtype and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"the rotary tables must be contiguous [{rows}, 1, head_dim] {dtype}")
        if len(caches) != len(self.layers):
            raise ValueError(f"{len(caches)} layers' caches for a stack of {len(self.layers)}")
        cache_shape = caches[0][0].shape
        if cache_shape[1:] != (shape.kv_heads, shape.head_dim):
            raise ValueError(f"caches of shape {tuple(cache_shape)} for {shape.kv_heads} kv heads")
        ptrs = []
        for tensors, (k, v) in zip(self._tensors, caches, strict=True):
            for cache in (k, v):
                if cache.shape != cache_shape or cache.dtype != dtype or not cache.is_contiguous():
                    raise ValueError(f"every cache must be contiguous {tuple(cache_shape)} {dtype}")
            ptrs += [0 if t is None else t.data_ptr() for t in tensors]
            ptrs += [k.data_ptr(), v.data_ptr()]
        table = torch.tensor(ptrs, dtype=torch.int64)
        h, kv, d, inter = shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
        dims = torch.tensor(
            [rows, hidden, h, kv, d, inter, cache_shape[0], batch.tables.shape[1],
             batch.block_size, int(dtype == torch.bfloat16), torch.get_num_threads()],
            dtype=torch.int64,
        )  # fmt: skip
        out = torch.empty(rows, hidden, dtype=dtype)
        scratch = torch.empty(rows * (4 * hidden + (2 * h + 2 * kv) * d + 3 * inter), dtype=dtype)
        rc = _library.dll.decode_stack(
            ctypes.addressof(_entry_points(dtype)),
            table.data_ptr(),
            len(self.layers),
            dims.data_ptr(),
            shape.eps,
            shape.scale,
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            scratch.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            batch.rows.data_ptr(),
            batch.tables.data_ptr(),
            batch.lens.data_ptr(),
        )
        if rc:
            layer, op = divmod(rc - 1, 4)
            what = {1: "rotary (head size)", 2: "a cache slot (outside the cache)", 3: "attention"}
            raise ValueError(f"decode stack: layer {layer} refused {what[op]}")
        return out

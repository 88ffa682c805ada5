"""Which of a model's weights are block-FP8, from the checkpoint's ``quantization_config`` or
the engine's ``quantization="fp8"`` (a float checkpoint quantized as it is loaded).

HF FP8 checkpoints (DeepSeek-V3, Qwen3-FP8) say ``{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}`` and list the modules left
unquantized in ``modules_to_not_convert`` (vLLM's key: ``ignored_layers``). tandem holds the
weights of its parallel linear layers (attention and MLP projections, experts) as e4m3 with
their block scales; embeddings, the output layer, MoE routers and norms keep the compute
dtype, as those checkpoints store them. Activations are not quantized: each matmul runs in
the compute dtype on the dequantized weight (`tandem.layers.fp8`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.errors import UnsupportedModelError
from tandem.layers.fp8 import SCALE_SUFFIX, quantize_blocks
from tandem.layers.linear import LinearBase

QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True, slots=True)
class Fp8Config:
    """``block``: the scale grid's block; ``ignored``: HF module names kept unquantized;
    ``stored``: the checkpoint holds e4m3 weights and scales (else float weights, quantized
    on load)."""

    block: tuple[int, int] = (128, 128)
    ignored: tuple[str, ...] = ()
    stored: bool = False

    @classmethod
    def from_hf(cls, raw: dict, file: str) -> Fp8Config:
        """From a checkpoint's ``quantization_config``; every field it cannot serve is an
        error naming the field."""

        def refuse(key: str, why: str):
            return UnsupportedModelError(why, file=file, field=f"quantization_config.{key}")

        if not isinstance(raw, dict):
            raise refuse("", "must be an object")
        method = raw.get("quant_method")
        if method != "fp8":
            raise refuse("quant_method", f"{method!r} is not supported; supported: ['fp8']")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise refuse("fmt", f"{raw['fmt']!r} is not supported; supported: ['e4m3']")
        block = raw.get("weight_block_size")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise refuse(
                "weight_block_size", f"must be two positive ints (block-wise FP8), got {block!r}"
            )
        if raw.get("scale_fmt") not in (None, "float32", "fp32"):
            raise refuse("scale_fmt", f"{raw['scale_fmt']!r} is not supported (float32 scales)")
        ignored = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
        if not (isinstance(ignored, list) and all(isinstance(m, str) for m in ignored)):
            raise refuse("modules_to_not_convert", "must be a list of module names")
        return cls(tuple(block), tuple(ignored), stored=True)

    def skips(self, weight_name: str) -> bool:
        """Whether the module holding canonical ``weight_name`` stays unquantized: it is, or
        lies under, or ends with one of the ``ignored`` dotted module names."""
        module = weight_name.rsplit(".", 1)[0]
        return any(
            module == m or module.startswith(m + ".") or module.endswith("." + m)
            for m in self.ignored
        )


def quantize_layers(model: nn.Module, config: Fp8Config) -> None:
    """Turn every parallel linear layer of ``model`` (on meta, before it gets storage) whose
    weights the config does not skip into block-FP8 (`tandem.layers.linear.fp8_blocks` lists
    them). A GPT-2 ``Conv1D`` weight ([in, out]) is not a block-FP8 layout: it stays float."""
    for layer in model.modules():
        if not isinstance(layer, LinearBase):
            continue
        names = [p.name for p in layer.weight.pieces]
        if any(p.transposed for p in layer.weight.pieces):
            continue
        skipped = [config.skips(n) for n in names]
        if all(skipped):
            continue
        if any(skipped):
            raise UnsupportedModelError(
                f"fused weights {names} are partly listed in modules_to_not_convert",
                field="quantization_config.modules_to_not_convert",
            )
        layer.to_fp8(config.block)


class QuantizedOnLoad:
    """A float checkpoint read as the block-FP8 one it quantizes to: ``X.weight`` of a
    converted layer reads as its e4m3 values and ``X.weight_scale_inv`` as its scales, made
    from the whole stored tensor with the reference quantizer (once per tensor)."""

    def __init__(self, read, converted: dict[str, tuple[int, int]]):
        self._read = read  # canonical name -> the stored tensor's slice handle
        self._converted = converted
        self._done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, name: str):
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in self._converted:
            return self._read(name)
        if weight not in self._done:
            full = self._read(weight)[:]
            self._done[weight] = quantize_blocks(full, self._converted[weight])
        values, scales = self._done[weight]
        return scales if name.endswith(SCALE_SUFFIX) else values

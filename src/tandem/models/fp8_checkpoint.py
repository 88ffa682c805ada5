"""Write a float Hugging Face checkpoint as a block-FP8 one, in the layout DeepSeek-V3 and
Qwen3-FP8 ship: ``X.weight`` in e4m3 and ``X.weight_scale_inv`` (float32, one per block) for
every weight tandem serves as FP8, the rest as it was, and ``quantization_config`` in
config.json. The tests and ``tandem make-tiny-model --quantization fp8`` make their FP8 models
with it (no model hub here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.layers.fp8 import quantize_blocks, scale_name
from tandem.layers.linear import fp8_blocks
from tandem.models.fp8 import Fp8Config, quantize_layers
from tandem.models.loader import checkpoint_files, read_model_spec


def save_fp8_checkpoint(
    src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)
) -> Path:
    """Quantize the float checkpoint in ``src`` into ``dst`` (may be ``src``: rewritten in
    place); the reference quantizer (`tandem.layers.fp8.quantize_blocks`) makes every value
    and scale."""
    src, dst = Path(src), Path(dst)
    spec = read_model_spec(src)
    if spec.fp8 is not None:
        raise ValueError(f"{src} is already a block-FP8 checkpoint")
    with torch.device("meta"):
        model = spec.cls(spec.config)
        quantize_layers(model, Fp8Config(tuple(block)))
    converted = fp8_blocks(model)
    tensors = {}
    for name, fname in checkpoint_files(src).items():
        with safe_open(fname, framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    for name in converted:
        tensors[name], tensors[scale_name(name)] = quantize_blocks(tensors[name], tuple(block))
    if dst != src:
        dst.mkdir(parents=True, exist_ok=True)
        for path in src.iterdir():
            if path.is_file() and not path.name.startswith("model.safetensors"):
                shutil.copy(path, dst / path.name)
    for path in dst.glob("model*.safetensors*"):
        path.unlink()
    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())}, str(dst / "model.safetensors")
    )
    config = json.loads((dst / "config.json").read_text())
    kept = sorted(
        name.removesuffix(".weight")
        for name, t in tensors.items()
        if t.dim() == 2
        and name.endswith(".weight")
        and name not in converted
        and scale_name(name) not in tensors
    )
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": kept,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

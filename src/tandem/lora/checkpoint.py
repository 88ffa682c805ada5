"""An adapter's tensors under canonical names: ``model.layers.0.self_attn.q_proj.lora_A.weight``
([r, in]) and ``...lora_B.weight`` ([out, r]), the names PEFT saves less its
``base_model.model.`` prefix. Read from a PEFT directory, a state dict, or a live PEFT model
(its adapter's parameters, plain or FSDP2/DTensor-sharded: what an adapter push sends)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.errors import LoRAError
from tandem.lora.config import AdapterConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# <module>.lora_A[.<adapter>].weight
_NAME = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def read_adapter(path: str | Path, name: str) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A PEFT directory's configuration and tensors (canonical names)."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LoRAError(f"adapter {name!r}: no {needed.name} in {path}")
    try:
        config = AdapterConfig.from_peft(json.loads(config_file.read_text()), f"adapter {name!r}")
    except json.JSONDecodeError as exc:
        raise LoRAError(f"adapter {name!r}: {config_file} is not JSON ({exc})") from None
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise LoRAError(f"adapter {name!r}: unreadable {weights_file} ({exc})") from None
    return config, canonical_tensors(tensors, config, name)


def canonical_tensors(
    tensors: Mapping[str, torch.Tensor],
    config: AdapterConfig,
    name: str,
    adapter: str | None = None,
) -> dict[str, torch.Tensor]:
    """``tensors`` (PEFT's names, saved or live) under canonical names; only those of adapter
    ``adapter`` where the names carry one. Every tensor must be a LoRA A or B of a target
    module, of rank ``config.rank``."""
    out: dict[str, torch.Tensor] = {}
    problems = []
    for key, tensor in tensors.items():
        match = _NAME.match(key.removeprefix(_PREFIX))
        if match is None:
            if "lora_" in key or adapter is None:
                problems.append(f"{key}: not a LoRA A or B weight")
            continue
        if adapter is not None and match["adapter"] not in (None, adapter):
            continue
        module, part = match["module"], match["part"]
        if module.rsplit(".", 1)[-1] not in config.targets:
            problems.append(f"{key}: module not in target_modules {list(config.targets)}")
            continue
        rank_dim = tensor.shape[0] if part == "lora_A" else tensor.shape[-1]
        if tensor.dim() != 2 or rank_dim != config.rank:
            problems.append(f"{key}: shape {tuple(tensor.shape)} is not of rank r={config.rank}")
            continue
        out[f"{module}.{part}.weight"] = tensor
    if not out and not problems:
        problems.append("no LoRA tensors")
    if problems:
        shown = "; ".join(problems[:10]) + (
            f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        )
        raise LoRAError(f"adapter {name!r}: {shown}")
    return out


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def peft_adapter(model, name: str) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A live PEFT model's active adapter: its configuration and parameters (the live
    tensors themselves, DTensors where FSDP2 sharded them) under canonical names."""
    adapter = model.active_adapter
    if not isinstance(adapter, str):  # several active adapters: one is pushed at a time
        raise LoRAError(
            f"adapter {name!r}: the PEFT model has active adapters {adapter}; "
            "set one with set_adapter()"
        )
    config = AdapterConfig.from_peft(model.peft_config[adapter], f"adapter {name!r}")
    params = {key: p for key, p in model.named_parameters() if "lora_" in key}
    return config, canonical_tensors(params, config, name, adapter)

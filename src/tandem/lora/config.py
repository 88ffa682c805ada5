"""An adapter's PEFT configuration, as far as serving it goes: rank, scaling, target modules.

PEFT writes ``adapter_config.json`` (``peft.LoraConfig``); the fields read here decide the
numbers, and every field that would change them in a way tandem does not implement (DoRA,
per-module ranks or alphas, trained biases, extra trained modules) is refused by name."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.errors import LoRAError

# the linear layers an adapter may target (Llama-style decoders)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ALL_LINEAR = "all-linear"


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """``rank`` (PEFT ``r``), ``alpha`` (``lora_alpha``), ``rslora`` (``use_rslora``: scale
    alpha / sqrt(r) instead of alpha / r) and the module names it adapts."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoRAError(f"r must be an int >= 1, got {self.rank!r}")
        unknown = sorted(set(self.targets) - set(LORA_MODULES))
        if unknown or not self.targets:
            raise LoRAError(
                f"target_modules: {unknown or 'none'} not servable; tandem serves "
                f"LoRA on {list(LORA_MODULES)}"
            )

    @property
    def scaling(self) -> float:
        """What PEFT multiplies B A x by."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def from_peft(cls, config: Any, name: str = "adapter") -> AdapterConfig:
        """From PEFT's config: a ``LoraConfig`` or its ``adapter_config.json`` as a dict."""
        if not isinstance(config, Mapping):
            to_dict = getattr(config, "to_dict", None)
            if to_dict is None:
                raise LoRAError(
                    f"{name}: lora_config must be a dict or a peft LoraConfig, "
                    f"got {type(config).__name__}"
                )
            config = to_dict()
        get = config.get
        peft_type = str(get("peft_type", "LORA")).rsplit(".", 1)[-1].upper()
        if peft_type != "LORA":
            raise LoRAError(f"{name}: peft_type {peft_type} is not LoRA")
        refused = {
            "use_dora": bool(get("use_dora")),
            "rank_pattern": bool(get("rank_pattern")),
            "alpha_pattern": bool(get("alpha_pattern")),
            "bias": get("bias", "none") not in (None, "none"),
            "modules_to_save": bool(get("modules_to_save")),
            "fan_in_fan_out": bool(get("fan_in_fan_out")),
            "layers_to_transform": get("layers_to_transform") is not None,
        }
        for field, set_ in refused.items():
            if set_:
                raise LoRAError(
                    f"{name}: adapter_config field {field}={get(field)!r} is not "
                    "supported by tandem's LoRA"
                )
        targets = get("target_modules")
        if targets == _ALL_LINEAR:
            targets = LORA_MODULES
        if isinstance(targets, str):  # a regex in PEFT: only plain names are served
            raise LoRAError(
                f"{name}: target_modules as a pattern ({targets!r}) is not "
                "supported; list the module names"
            )
        targets = tuple(sorted(set(targets or ()), key=_module_order))
        rank = get("r", 8)
        alpha = get("lora_alpha", 8)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise LoRAError(f"{name}: lora_alpha must be a number, got {alpha!r}")
        try:
            return cls(rank, float(alpha), targets, bool(get("use_rslora", False)))
        except LoRAError as exc:
            raise LoRAError(f"{name}: {exc}") from None


def _module_order(module: str) -> int:
    return LORA_MODULES.index(module) if module in LORA_MODULES else len(LORA_MODULES)

"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.errors import LoRAError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name. ``lora_path``: a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) loaded on first use; ``lora_tensors`` with ``lora_config``
    (PEFT's config as a dict, or a ``peft.LoraConfig``): the adapter from memory, names as
    PEFT saves them; neither: an adapter the engine holds already (loaded before, or pushed by
    a trainer with ``WeightSender(peft_model, llm, lora_name=...)``: the latest version
    pushed). ``lora_int_id`` is vLLM's id, kept for compatibility: the name identifies."""

    lora_name: str
    lora_int_id: int
    lora_path: str | None = None
    lora_tensors: Mapping[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    lora_config: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise LoRAError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_path is not None and self.lora_tensors is not None:
            raise LoRAError(f"adapter {self.lora_name!r}: give lora_path or lora_tensors, not both")
        if (self.lora_tensors is None) != (self.lora_config is None):
            raise LoRAError(f"adapter {self.lora_name!r}: lora_tensors and lora_config go together")

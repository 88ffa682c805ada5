"""Typed errors raised by tandem's public entry points."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory cannot be loaded: names the file and, where known, the field."""

    def __init__(self, message: str, *, file: str, field: str | None = None):
        where = file if field is None else f"{file}: {field}"
        super().__init__(f"{where}: {message}")
        self.file = file
        self.field = field


class UnsupportedModelError(ModelLoadError):
    """The directory is readable but describes an architecture or option tandem does not run."""


class LoRAError(ValueError):
    """A LoRA adapter cannot be served: unknown, malformed, above ``max_lora_rank``, more
    adapters than ``max_loras`` slots, or LoRA not enabled. Names the adapter and the field."""


class LoRASlotsFull(LoRAError):
    """Every LoRA slot holds an adapter that requests run with (or that cannot come back if
    evicted): no adapter can be loaded now."""

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


class StaleVersionError(ValueError):
    """A push names a version not greater than the one its target serves (a fleet: the newest
    any replica holds; a LoRA adapter: that adapter's latest), without ``rollback=True``.
    Refused before any byte moves: the target keeps serving its weights untouched. Names both
    versions (``requested``, ``served``) and, for an adapter, its name (``adapter``)."""

    def __init__(self, requested: int, served: int, adapter: str | None = None):
        what = "the target serves" if adapter is None else f"adapter {adapter!r} serves"
        super().__init__(
            f"version {requested} is not greater than version {served} {what}: versions only "
            f"go forward; push a version above {served}, or push(version={requested}, "
            f"rollback=True) to roll back on purpose"
        )
        self.requested = requested
        self.served = served
        self.adapter = adapter

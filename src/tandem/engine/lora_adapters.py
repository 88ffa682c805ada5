"""The engine's LoRA adapters, as callers see them: load one (a PEFT directory or tensors in
memory), unload it, list them, and pin the one a request runs with.

Loading is a push the engine makes to itself (`WeightSender` with ``lora_name`` into its own
exchange server): an adapter from a directory lands exactly as a trainer's push does, planned
by the slots' placement, checksummed where it lands. Which version is in which slot is
`tandem.engine.lora_registry`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from tandem.engine.engine_lock import EngineLock
from tandem.engine.lora_registry import LoadedAdapter, LoRARegistry
from tandem.errors import LoRAError
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import AdapterPush, AdapterSlot
from tandem.lora.checkpoint import canonical_tensors, read_adapter
from tandem.lora.config import AdapterConfig
from tandem.lora.request import LoRARequest


class Adapters:
    """The engine's LoRA adapters (``registry``: the slots, or None without ``enable_lora``);
    loads go through the engine's own exchange server (``exchange_address`` makes it)."""

    def __init__(
        self, registry: LoRARegistry | None, lock: EngineLock, exchange_address: Callable[[], str]
    ):
        self.registry = registry
        self._lock = lock
        self._exchange_address = exchange_address

    def _registry(self) -> LoRARegistry:
        if self.registry is None:
            raise LoRAError("LoRA is not enabled: start the engine with enable_lora=True")
        return self.registry

    def loaded(self) -> list[LoadedAdapter]:
        """The latest version of every adapter loaded (none without LoRA)."""
        return [] if self.registry is None else self.registry.adapters()

    def load(
        self,
        name: str,
        path: str | None = None,
        *,
        int_id: int | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        config=None,
    ) -> LoadedAdapter:
        """Load adapter ``name`` from PEFT directory ``path``, or from ``tensors`` (PEFT's
        names) with ``config`` (PEFT's config); a loaded one of that name gets a new version.
        Raises `LoRAError` (and loads nothing) for a malformed adapter, a rank above
        ``max_lora_rank``, or no free slot."""
        registry = self._registry()
        if path is not None:
            adapter_config, canonical = read_adapter(path, name)
        elif tensors is not None and config is not None:
            adapter_config = AdapterConfig.from_peft(config, f"adapter {name!r}")
            canonical = canonical_tensors(tensors, adapter_config, name)
        else:
            raise LoRAError(f"adapter {name!r}: give a path, or tensors with their config")
        if adapter_config.rank > registry.max_rank:
            raise LoRAError(
                f"adapter {name!r}: rank {adapter_config.rank} is above "
                f"max_lora_rank {registry.max_rank}"
            )
        from tandem.exchange.receiver import WeightSyncError
        from tandem.exchange.sender import WeightSender

        with self._lock.control():
            registry.slot_for(name)  # LoRASlotsFull now, not as a failed push's message
        registry.set_source(name, int_id, None if path is None else str(path))
        sender = WeightSender(
            canonical, self._exchange_address(), lora_name=name, lora_config=adapter_config
        )
        try:
            sender.push()
        except WeightSyncError as exc:
            raise LoRAError(f"adapter {name!r} did not load: {exc}") from None
        finally:
            sender.close()
            registry.drop_source(name)  # the commit took it, or the load failed
        return registry.latest(name)

    def plan_push(
        self, push: AdapterPush, layouts: list[RankLayout]
    ) -> tuple[list[RankLayout], AdapterSlot, int | None]:
        """Where a push of adapter ``push`` lands (`LoRARegistry.plan_push`, under the lock)."""
        with self._lock.control():
            return self._registry().plan_push(push, layouts)

    def unload(self, name: str) -> None:
        with self._lock.control():
            self._registry().unload(name)

    def pin(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter version ``request`` runs with, held in its slot until `unpin`;
        loaded first from ``lora_path`` / ``lora_tensors`` when the engine lacks it."""
        registry = self._registry()
        if registry.latest(request.lora_name) is None:
            if request.lora_path is None and request.lora_tensors is None:
                raise LoRAError(
                    f"adapter {request.lora_name!r} is not loaded and the request "
                    "gives no lora_path"
                )
            self.load(
                request.lora_name,
                request.lora_path,
                int_id=request.lora_int_id,
                tensors=request.lora_tensors,
                config=request.lora_config,
            )
        with self._lock.control():
            return registry.pin(request.lora_name)

    def unpin(self, adapter: LoadedAdapter) -> None:
        with self._lock.control():
            self._registry().unpin(adapter.slot)

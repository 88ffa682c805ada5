"""One engine as a weight-push target (`tandem.exchange.WeightTarget` and `AdapterTarget`),
built on the engine's public parts: its ranks' layouts, its push window, its LoRA adapters and
its lifecycle. The exchange server trainers push into is the target's (started on first use);
a fleet drives each replica's target (`tandem.fleet.target.FleetTarget`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from tandem.engine.weight_update import WeightUpdate
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import AdapterPush, AdapterSlot, PushSettings, UpdateSpec


class EngineTarget:
    def __init__(self, engine):  # an `LLMEngine` (its module imports this one)
        self._engine = engine
        self._exchange = None

    def exchange_server(self):
        """The exchange server trainers push into (started on first use)."""
        if self._exchange is None:
            from tandem.exchange.server import ExchangeServer

            config = self._engine.config
            # the transport's own waits end first: an error, not a rank declared dead
            timeout = config.parallel.push_phase_timeout_s
            self._exchange = ExchangeServer(
                self, host=config.exchange_host, stage_timeout_s=timeout
            )
        return self._exchange

    @property
    def weight_version(self) -> int:
        return self._engine.weight_version

    @property
    def weight_base(self) -> str | None:
        return self._engine.window.base

    @property
    def update_listeners(self) -> list[Callable[[int, float, str | None], None]]:
        return self._engine.window.update_listeners

    @property
    def weight_dtype(self) -> str:
        return self._engine.config.dtype

    @property
    def weight_device_type(self) -> str:
        return self._engine.config.torch_device.type

    @property
    def receivers_in_process(self) -> bool:
        return self._engine.window.in_process

    def weight_layouts(self) -> list[RankLayout]:
        """What every rank holds, as canonical boxes: the receiving side of exchange plans."""
        return self._engine.window.layouts

    def unavailable(self) -> str | None:
        return self._engine.unavailable()

    def refuses(self, settings: PushSettings) -> str | None:
        """Every transport's every mode (their coordinators check the rest); a LoRA
        adapter's push needs ``enable_lora`` and lands staged (its slot is cleared and
        written at the commit, while the version before it serves until then)."""
        if settings.adapter is None:
            return None
        if self._engine.adapters.registry is None:
            return "this engine serves no LoRA adapters (start it with enable_lora=True)"
        if settings.in_place:
            return "a LoRA adapter's push is staged (mode='staged'): adapters are small"
        if settings.rolling:
            return "policy='rolling' is for fleets; one engine commits an adapter at once"
        return None

    def adapter_plan(self, push: AdapterPush) -> tuple[list[RankLayout], AdapterSlot, int | None]:
        """The receiving layouts of a push of LoRA adapter ``push`` (into the slot it takes),
        where it lands, and the adapter's latest version (None: none is loaded)."""
        return self._engine.adapters.plan_push(push, self.weight_layouts())

    def weight_update(self, spec: UpdateSpec) -> AbstractContextManager[WeightUpdate]:
        """The window of one push (`PushWindow.weight_update`)."""
        return self._engine.window.weight_update(spec)

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()

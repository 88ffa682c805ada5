"""The engine as a weight-push target (`tandem.exchange.WeightTarget`): its ranks' layouts,
dtype and device, and the window in which one push's phases run while no step does
(`tandem.engine.weight_update`, driven by the exchange server)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tandem.engine.executor import InProcessExecutor
from tandem.engine.messages import RestoreWeights
from tandem.engine.weight_update import WeightUpdate
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import AdapterPush, AdapterSlot, PushPhase, PushSettings, UpdateSpec


class PushWindow:
    """Mixed into `LLMEngine`: its lock, lifecycle, blocks and executor. With the engine's
    ``weight_version`` and ``update_listeners`` it makes the engine a `WeightTarget`."""

    _exchange = None

    def exchange_server(self):
        if self._exchange is None:
            from tandem.exchange.server import ExchangeServer

            # the transport's own waits end first: an error, not a rank declared dead
            timeout = self.config.parallel.push_phase_timeout_s
            self._exchange = ExchangeServer(self, host=self.config.exchange_host,
                                            stage_timeout_s=timeout)  # fmt: skip
        return self._exchange

    @property
    def weight_dtype(self) -> str:
        return self.config.dtype

    @property
    def weight_device_type(self) -> str:
        return self.config.torch_device.type

    @property
    def receivers_in_process(self) -> bool:
        return isinstance(self.executor, InProcessExecutor)

    def weight_layouts(self) -> list[RankLayout]:
        """What every rank holds, as canonical boxes: the receiving side of exchange plans."""
        return self.executor.layouts

    def unavailable(self) -> str | None:
        return self.lifecycle.unavailable()

    def refuses(self, settings: PushSettings) -> str | None:
        """Every transport's every mode (their coordinators check the rest); a LoRA
        adapter's push needs ``enable_lora`` and lands staged (its slot is cleared and
        written at the commit, while the version before it serves until then)."""
        if settings.adapter is None:
            return None
        if self.lora is None:
            return "this engine serves no LoRA adapters (start it with enable_lora=True)"
        if settings.in_place:
            return "a LoRA adapter's push is staged (mode='staged'): adapters are small"
        if settings.rolling:
            return "policy='rolling' is for fleets; one engine commits an adapter at once"
        return None

    def adapter_plan(self, push: AdapterPush
                     ) -> tuple[list[RankLayout], AdapterSlot, int | None]:  # fmt: skip
        """The receiving layouts of a push of LoRA adapter ``push`` (into the slot it takes),
        where it lands, and the adapter's latest version (None: none is loaded)."""
        with self._control():
            return self.lora.plan_push(push, self.weight_layouts())

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[WeightUpdate]:
        """A window for one push: steps already in flight (pipeline) finish, then no step runs
        until it closes; the caller runs the push's phases in it (`WeightUpdate.run`).
        Waiting and running requests go on afterwards with the new weights, each recording
        the versions it used. The lock is held only while a phase runs, never while the caller
        waits on trainers."""
        with self._control():
            self._drain_in_flight()
            self.lifecycle.check_alive()
            if self.lifecycle.weights_released:  # sleep(level=2): memory for the push first
                self._weight_memory(RestoreWeights())
            if spec.adapter is not None:  # the slot's adapter leaves (LoRARegistry.begin)
                self.lora.begin(spec.adapter)
            self.lifecycle.open_update()
            update = WeightUpdate(self, spec, self.weight_version)
        adapter = spec.adapter
        try:
            yield update
        except BaseException as exc:
            if adapter is not None:  # the slot may be half-written: it serves nothing now
                update.torn = None
                self.lora.failed(adapter, intact=not update.exposed)
            elif update.exposed and update.torn is None:  # broke after writing live weights
                update.torn = f"the push of version {spec.version} broke: {exc}"
            try:
                self.apply_phase(PushPhase.ABORT, spec, {})  # every rank drops what it held
            except Exception:  # a dead rank: the engine is marked dead by apply_phase
                pass
            raise
        finally:
            with self._control():
                if update.landed or update.exposed:  # cached KV came from the old weights
                    self.blocks.reset_prefix_cache()
                if adapter is None:
                    self.lifecycle.close_update(update.torn, update.landed)
                    if update.torn is None and update.landed:  # the spec's version (a driver
                        self.weight_version = update.spec.version  # may name it at commit)
                else:  # the base weights are as they were; the adapter's version is its own
                    self.lifecycle.close_update(None, False)
                    if update.landed:
                        self.lora.committed(adapter, update.spec.version)
                self._resumed.notify_all()

    def relabel_weights(self, version: int) -> None:
        """Call the weights being served ``version`` from now on (vLLM's
        ``/update_weight_version``: a trainer names the version after its push landed)."""
        with self._control():
            self.weight_version = version

    def apply_phase(self, phase: PushPhase, spec: UpdateSpec,
                    records_by_rank: dict[int, list]):  # fmt: skip
        """One phase of a push on every rank, under the engine lock: (errors, bytes moved)."""
        with self._control():
            return self._guarded(lambda: self.executor.apply(phase, spec, records_by_rank))

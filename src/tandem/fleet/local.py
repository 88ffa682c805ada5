"""A replica that is an `LLMEngine` of this process (its workers are processes of their own):
the replicas of `LLM(data_parallel_size=R)` and of `tandem serve --data-parallel-size R`."""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.executor import ReplicaSlot
from tandem.engine.state import EngineState
from tandem.exchange.target import WeightTarget
from tandem.fleet.peer import push_from_peer
from tandem.fleet.replica import Health, Replica

FAULTS = (EngineState.DEAD, EngineState.TORN)  # what quarantines a replica


class LocalReplica:
    """Replica ``index`` of a fleet whose engines run here (``config`` is the fleet's; the
    replica's slot among the fleet's, grown past its size by an added one, puts its workers
    on their own cores and devices)."""

    kind = "engine"
    in_process = True

    def __init__(self, config: EngineConfig, index: int, load_format: str = "auto"):
        self.config = config
        self.index = index
        slot = ReplicaSlot(index, max(config.parallel.data_parallel_size, index + 1))
        self.engine = LLMEngine(config.model_copy(update={"load_format": load_format}), slot)
        self.name = f"replica {index}"
        self.block = self.engine.config.cache.block_size
        self.cache_blocks = self.engine.stats().kv_blocks_total

    @property
    def target(self) -> WeightTarget:
        return self.engine.target

    @property
    def version(self) -> int:
        return self.engine.weight_version

    def health(self) -> Health:
        engine = self.engine
        engine.check_health()  # a worker gone while idle
        why = engine.unavailable()  # dead, torn, no weights loaded
        fault = (why or engine.state.value) if engine.state in FAULTS else None
        # ok: routed to (an engine without weights refuses a request itself, saying why)
        return Health(
            ok=fault is None,
            version=engine.weight_version,
            fault=fault,
            reason=why,
            updating=engine.controls.lifecycle.updating,
        )

    def refresh(self) -> None:
        self.engine.check_health()

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def lost(self, reason: str) -> bool:
        # dead or torn: quarantined, healed; a replica restarted since (the loss was its old
        # engine's) is left serving
        return self.health().fault is not None

    def receive_address(self) -> str:
        return self.engine.target.exchange_server().address

    def send_to(self, other: Replica, timeout_s: float) -> int:
        version = self.engine.weight_version
        push_from_peer(self.engine, other.receive_address(), timeout_s)
        return version

    def paused(self) -> str | None:
        return self.engine.controls.paused

    def pause(self, mode: str) -> None:
        self.engine.controls.pause(mode)

    def restarted(self) -> LocalReplica | None:
        if self.engine.state is not EngineState.DEAD:
            return None
        self.engine.shutdown()
        return LocalReplica(self.config, self.index, load_format="dummy")

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        self.engine.shutdown()

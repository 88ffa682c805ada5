"""A fleet: ``data_parallel_size`` independent engines (each its own tensor x pipeline worker
processes) behind one front. The front routes each request to one replica (`Router`), drives
every replica with work on a thread of its own, fans the RL controls out to all of them, and
is one `WeightTarget` for pushes (`tandem.engine.fleet_target`): one push updates every replica.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.fleet_target import FleetTarget
from tandem.engine.router import Routed, Router
from tandem.engine.sequence import Sequence


class Fleet:
    """The replicas of one `LLM` (one replica: a fleet of one, stepped in the caller's thread)."""

    def __init__(self, config: EngineConfig):
        replicas = config.parallel.data_parallel_size
        configs = [
            config.model_copy(update={"parallel": config.parallel.model_copy(
                update={"data_parallel_rank": r})})
            for r in range(replicas)
        ]  # fmt: skip
        if replicas == 1:
            self.engines = [LLMEngine(configs[0])]
        else:
            self.engines = _start_all(configs)
        lead = self.engines[0]
        self.router = Router(replicas, lead.config.cache.block_size, lead.blocks.num_blocks)
        self.lock = threading.Lock()  # the router's
        self.target = (
            lead
            if replicas == 1
            # what pushes update
            else FleetTarget(self.engines, lead.config.exchange_host)
        )
        self.target.update_listeners.append(self._pushed)

    @property
    def lead(self) -> LLMEngine:
        """Replica 0: its config, model spec and tokenizer are every replica's."""
        return self.engines[0]

    def route(self, prompt_ids: list[int], samples: int, max_tokens: int) -> Routed:
        with self.lock:
            return self.router.route(prompt_ids, samples, max_tokens)

    def finished(self, routed: Routed) -> None:
        with self.lock:
            self.router.finished(routed)

    def _pushed(self, version: int, seconds: float, error: str | None) -> None:
        """A push emptied the replicas' prefix caches (`LLMEngine.weight_update`)."""
        self.forget_prefixes()

    def forget_prefixes(self) -> None:
        """The replicas' prefix caches were reset: route as if nothing is cached."""
        with self.lock:
            self.router.forget()

    def run(self, work: dict[int, list[Sequence]]) -> None:
        """Step each replica until its sequences in ``work`` (replica -> sequences, queued
        there) are finished: the first in this thread, the others each on a thread of its own.
        The first error of any replica is raised once every replica stopped."""
        items = [(r, seqs) for r, seqs in sorted(work.items()) if seqs]
        if len(items) <= 1:
            for r, seqs in items:
                _drive(self.engines[r], seqs)
            return
        errors: list[BaseException] = []

        def drive(r: int, seqs: list[Sequence]) -> None:
            try:
                _drive(self.engines[r], seqs)
            except BaseException as exc:
                errors.append(exc)
                for other, mine in work.items():  # the caller gets its error now, not after all
                    self.engines[other].abort([s for s in mine if not s.finished])

        threads = [threading.Thread(target=drive, args=item, name=f"tandem-replica-{item[0]}",
                                    daemon=True) for item in items[1:]]  # fmt: skip
        for t in threads:
            t.start()
        drive(*items[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def each(self, call) -> list:
        """``call(engine)`` on every replica at once; their results in replica order (the
        first error is raised once all returned)."""
        if len(self.engines) == 1:
            return [call(self.engines[0])]
        with ThreadPoolExecutor(len(self.engines)) as pool:
            futures = [pool.submit(call, engine) for engine in self.engines]
        return [f.result() for f in futures]

    def exchange_server(self):
        """Where trainers push: the engine's own exchange server, or with several replicas
        the fleet's (one push updates every replica)."""
        return self.target.exchange_server()

    @property
    def update_listeners(self) -> list:
        """Called after every push into the fleet (`tandem.exchange.WeightTarget`)."""
        return self.target.update_listeners

    @property
    def weight_version(self) -> int:
        return min(engine.weight_version for engine in self.engines)

    def worker_locations(self) -> list[dict]:
        return [{**loc, "replica": r}
                for r, engine in enumerate(self.engines)
                for loc in engine.executor.worker_locations()]  # fmt: skip

    def fleet_state(self) -> list[dict]:
        with self.lock:
            loads = list(self.router.loads)
        return [{"replica": r, "state": _state(engine), "version": engine.weight_version,
                 "load": loads[r]} for r, engine in enumerate(self.engines)]  # fmt: skip

    def shutdown(self) -> None:
        if self.target is not self.lead:
            self.target.close()
        for engine in self.engines:
            engine.shutdown()


def _start_all(configs: list[EngineConfig]) -> list[LLMEngine]:
    """Start replica 0, then the others side by side (each waits on its own workers; what a
    process sets up once, such as joining a Ray cluster, the first one has done); if any
    fails, the others are shut down and the first error raised."""
    first = LLMEngine(configs[0])
    with ThreadPoolExecutor(len(configs) - 1) as pool:
        futures = [pool.submit(LLMEngine, c) for c in configs[1:]]
    engines, errors = [first], []
    for f in futures:
        try:
            engines.append(f.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for engine in engines:
            engine.shutdown()
        raise errors[0]
    return engines


def _drive(engine: LLMEngine, seqs: list[Sequence]) -> None:
    while not all(s.finished for s in seqs):  # other threads' requests may still run
        engine.step(for_seqs=seqs)


def _state(engine: LLMEngine) -> str:
    if engine.lifecycle.updating:
        return "updating"
    if engine.unavailable() is not None:
        return "quarantined"
    return "serving"

"""Where model steps run. The engine core submits step messages and collects results in order."""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tandem.config import EngineConfig
from tandem.engine.messages import (
    EncodeMessage,
    EncodeResult,
    ScoreMessage,
    StepMessage,
    StepResult,
    WeightMemoryMessage,
)
from tandem.engine.model_runner import ModelRunner
from tandem.exchange.adapters.engine import engine_layout
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import RankReceiver
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.models.loader import ModelSpec


class EngineDeadError(RuntimeError):
    """A worker process died or stopped answering; this engine cannot serve any more."""


class Executor(Protocol):
    num_blocks: int  # KV blocks every rank can hold (the minimum over ranks)
    max_in_flight: int  # steps that may be submitted before the oldest is collected
    layouts: list[RankLayout]  # what each rank holds, for weight-exchange plans
    in_process: bool  # the ranks run in the engine's own process (one rank: the whole model)

    def apply(
        self, phase: PushPhase, spec: UpdateSpec, records_by_rank: dict[int, list[Record]]
    ) -> tuple[list[str], int]:
        """Run one phase of a weight push on every rank: (the ranks' errors, bytes moved)."""

    def submit(self, msg: StepMessage) -> None: ...

    def weight_memory(self, msg: WeightMemoryMessage) -> list[str]:
        """Release, restore or reload every rank's parameters (sleep level 2, before a push,
        `reload_weights`): the errors the ranks reported."""

    def set_kv_cache(self, allocate: bool) -> None:
        """Release (False) or re-allocate (True) every rank's KV cache."""

    def check_alive(self) -> None:
        """Raise EngineDeadError if a worker is known to be gone (cheap; called when idle)."""

    def collect(self) -> StepResult:
        """The result of the oldest submitted step not yet collected."""

    def encode(self, msg: EncodeMessage) -> EncodeResult:
        """Pooled outputs of whole sequences (embed / classify); no step may be in flight."""

    def score(self, msg: ScoreMessage) -> torch.Tensor:
        """Next-token logits (or log-probs) at every position of the message's sequences, end
        to end: float32 [positions, vocab] on the CPU; no step may be in flight."""

    def worker_locations(self) -> list[dict]:
        """Where each rank runs: ``{rank, node_id, pid}``."""

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list:
        """``func(model)`` on every rank's model: the results in rank order; no step may be in
        flight. Only where the ranks run in this process: tandem sends no code to a worker."""

    def shutdown(self) -> None: ...


def kv_blocks(capacities: list[int]) -> int:
    num_blocks = min(capacities)
    if num_blocks < 1:
        raise ValueError("kv_cache_memory leaves room for no KV block; raise kv_cache_memory")
    return num_blocks


@dataclass(frozen=True, slots=True)
class ReplicaSlot:
    """Where an engine's workers sit among the replicas of a fleet on one host: replica
    ``index`` of ``size`` (its workers take the cores and devices after those of the replicas
    before it; on Ray, replicas spread over the nodes). An engine given none runs alone."""

    index: int = 0
    size: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.size:
            raise ValueError(
                f"replica slot {self.index} of {self.size}: the index must be in [0, {self.size})"
            )


class InProcessExecutor:
    """One rank holding the whole model, in the engine's own process."""

    max_in_flight = 1
    in_process = True

    def __init__(self, spec: ModelSpec, config: EngineConfig):
        self.runner = ModelRunner(
            spec,
            dtype=config.torch_dtype,
            device=config.torch_device,
            block_size=config.cache.block_size,
            seed=config.seed,
            packed_weights=config.packed_weights,
            paged_kernels=config.paged_kernels,
            host_memory_reuse=config.host_memory_reuse,
            load=config.load_format == "auto",
            lora=config.lora if config.lora.enable_lora else None,
        )
        self.num_blocks = kv_blocks([self.runner.kv_capacity(config.cache.kv_cache_memory)])
        self.runner.allocate_kv_cache(self.num_blocks)
        self.layouts = [engine_layout(self.runner.model, 0, self.runner.arena)]
        self.receiver = RankReceiver(self.runner.model, 0, config.torch_device)
        self._results: deque[StepResult] = deque()

    def apply(self, phase: PushPhase, spec: UpdateSpec, records_by_rank: dict[int, list[Record]]):
        """One phase of a push on this rank: (errors, bytes moved)."""
        error, nbytes = self.receiver.handle(phase, spec, records_by_rank.get(0, []))
        return ([] if error is None else [error]), nbytes

    def submit(self, msg: StepMessage) -> None:
        self._results.append(self.runner.execute(msg))

    def check_alive(self) -> None:
        pass

    def weight_memory(self, msg: WeightMemoryMessage) -> list[str]:
        """Release, restore or reload the parameters' memory: the errors reported."""
        error = self.runner.weights.handle(msg)
        return [] if error is None else [error]

    def set_kv_cache(self, allocate: bool) -> None:
        if allocate:
            self.runner.allocate_kv_cache(self.num_blocks)
        else:
            self.runner.release_kv_cache()

    def collect(self) -> StepResult:
        return self._results.popleft()

    def encode(self, msg: EncodeMessage) -> EncodeResult:
        return self.runner.encode(msg)

    def score(self, msg: ScoreMessage) -> torch.Tensor:
        return torch.cat(list(self.runner.score_rows(msg)))

    def worker_locations(self) -> list[dict]:
        return [{"rank": 0, "node_id": socket.gethostname(), "pid": os.getpid()}]

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list:
        return [func(self.runner.model)]

    def shutdown(self) -> None:
        # the model's attention layers hold views of the KV cache, and the model outlives the
        # runner here (the receiver, the layouts): free it now, not at a later collection
        if self.runner is not None:
            self.runner.release_kv_cache()
        self.runner = None

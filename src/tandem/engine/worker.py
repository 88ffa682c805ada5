"""A model worker process: one tensor/pipeline-parallel rank.

Started as ``python -m tandem.engine.worker``, or forked from a template that imported this
module (`tandem.engine.launcher`), with its arguments as JSON in the environment
(``TANDEM_WORKER``), never pickled. It joins the torch.distributed group through the engine's
c10d rendezvous, loads its shard, reports its KV capacity, then runs every step message in order
until told to stop. When the engine's connection closes, the worker exits.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.engine import control
from tandem.engine.launcher import name_process
from tandem.engine.messages import (
    ApplyResult,
    ApplyWeights,
    Capacity,
    EncodeMessage,
    Failure,
    Hello,
    KVCache,
    KVCacheDone,
    ScoreMessage,
    Shutdown,
    Start,
    StepMessage,
    WeightMemoryMessage,
    WeightsDone,
)
from tandem.engine.model_runner import ModelRunner
from tandem.exchange.adapters.engine import engine_layout
from tandem.exchange.receiver import RankReceiver
from tandem.models.loader import read_model_spec
from tandem.models.registry import import_model_modules
from tandem.models.stages import split_layers
from tandem.parallel import TPGroup

ENV = "TANDEM_WORKER"
WORKER_MODULE = "tandem.engine.worker"


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    local_rank: int
    local_world_size: int
    config: dict  # EngineConfig fields
    rendezvous: str  # the c10d store: file://PATH or tcp://HOST:PORT
    control_host: str
    control_port: int
    token: str
    model_modules: list[str]  # modules to import so custom architectures are registered

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> WorkerArgs:
        return cls(**json.loads(os.environ[ENV]))


class PipeChannel:
    """Hidden states between neighbouring pipeline stages (same TP rank), point to point.
    Sends are asynchronous so a stage can start its next step while the previous one travels."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device):
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=self.prev_rank)
        return buf

    def send(self, hidden: torch.Tensor) -> None:
        self.flush()
        hidden = hidden.contiguous()
        self._pending = (dist.isend(hidden, dst=self.next_rank), hidden)

    def flush(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def main() -> int:
    args = WorkerArgs.from_env()
    name_process(f"tandem-w{args.local_rank}")
    config = EngineConfig(**args.config)
    hello = Hello(args.rank, os.getpid())
    sock = control.connect(args.control_host, args.control_port, args.token, hello)
    try:
        run(args, config, sock)
    except control.PeerGone:
        return 0  # the engine went away: nothing left to serve
    except Exception as exc:
        traceback.print_exc()
        try:
            control.send(sock, Failure(args.rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def run(args: WorkerArgs, config: EngineConfig, sock) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.local_world_size))
    import_model_modules(args.model_modules)
    dims = config.parallel.dims
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", args.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=_rendezvous_store(args.rendezvous, dims.world_size, config),
        rank=args.rank,
        world_size=dims.world_size,
        timeout=timedelta(seconds=config.parallel.collective_timeout_s),
    )
    pp_rank, tp_rank = dims.coords(args.rank)
    tp_groups = [dist.new_group(dims.tp_ranks(p)) for p in range(dims.pp)]
    tp = TPGroup(tp_rank, dims.tp, tp_groups[pp_rank])
    spec = read_model_spec(config.model, config.quantization)
    stage = split_layers(spec.num_layers, dims.pp, config.parallel.pipeline_layer_split)[pp_rank]
    pipe = PipeChannel(
        dims.rank(pp_rank - 1, tp_rank) if not stage.is_first else None,
        dims.rank(pp_rank + 1, tp_rank) if not stage.is_last else None,
        device,
    )
    runner = ModelRunner(
        spec,
        dtype=config.torch_dtype,
        device=device,
        block_size=config.cache.block_size,
        seed=config.seed,
        tp=tp,
        stage=stage,
        pipe=pipe,
        samples=tp_rank == 0,
        packed_weights=config.packed_weights,
        paged_kernels=config.paged_kernels,
        host_memory_reuse=config.host_memory_reuse,
        load=config.load_format == "auto",
        lora=config.lora if config.lora.enable_lora else None,
    )
    layout = engine_layout(runner.model, args.rank, runner.arena)
    capacity = runner.kv_capacity(config.cache.kv_cache_memory)
    control.send(sock, Capacity(args.rank, capacity, layout))
    start = control.recv(sock)
    if not isinstance(start, Start):
        raise RuntimeError(f"expected Start, got {type(start).__name__}")
    runner.allocate_kv_cache(start.num_blocks)
    receiver = RankReceiver(runner.model, args.rank, device)
    while True:
        msg = control.recv(sock)
        if isinstance(msg, Shutdown):
            pipe.flush()
            return
        if isinstance(msg, ApplyWeights):
            error, nbytes = receiver.handle(msg.phase, msg.update, msg.records)
            control.send(sock, ApplyResult(args.rank, msg.phase, error, nbytes))
            continue
        if isinstance(msg, WeightMemoryMessage):
            control.send(sock, WeightsDone(args.rank, runner.weights.handle(msg)))
            continue
        if isinstance(msg, KVCache):
            if msg.allocate:
                runner.allocate_kv_cache(start.num_blocks)
            else:
                runner.release_kv_cache()
            control.send(sock, KVCacheDone(args.rank, msg.allocate))
            continue
        if isinstance(msg, ScoreMessage):
            for part in runner.score(msg):  # every rank runs it through (collectives)
                control.send(sock, part)
            continue
        if isinstance(msg, EncodeMessage):
            result = runner.encode(msg)
        elif isinstance(msg, StepMessage):
            result = runner.execute(msg)
        else:
            raise RuntimeError(f"unexpected control message {type(msg).__name__}")
        if result is not None:
            control.send(sock, result)


def _rendezvous_store(address: str, world_size: int, config: EngineConfig) -> dist.Store:
    """The engine's c10d store: a private file on one host, else the engine's TCP store (the
    engine hosts it, so every rank is a client)."""
    if address.startswith("file://"):
        store = dist.FileStore(address.removeprefix("file://"), world_size)
    else:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=timedelta(seconds=config.parallel.worker_start_timeout_s),
        )
    return dist.PrefixStore("process_group", store)


if __name__ == "__main__":
    sys.exit(main())

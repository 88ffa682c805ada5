"""The multi-process executor: T x P worker processes joined by torch.distributed.

The engine process hosts the c10d rendezvous store and the control server; it holds no model
rank itself, so a dead or stuck worker can never block it inside a collective. Workers on this
host are started here; workers on other hosts by `tandem serve --node-rank N` (`run_node`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.engine.control import ControlServer, PeerGone
from tandem.engine.executor import EngineDeadError, ReplicaSlot, kv_blocks
from tandem.engine.launcher import start_process
from tandem.engine.messages import (
    CONTROL,
    ApplyResult,
    ApplyWeights,
    Capacity,
    ControlAddress,
    EncodeMessage,
    EncodeResult,
    KVCache,
    KVCacheDone,
    ScoreMessage,
    ScoreResult,
    Shutdown,
    Start,
    StepMessage,
    StepResult,
    WeightMemoryMessage,
    WeightsDone,
)
from tandem.engine.worker import ENV, WORKER_MODULE, WorkerArgs
from tandem.exchange.items import Record
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.models.loader import ModelSpec, read_model_spec
from tandem.models.registry import import_model_modules
from tandem.models.stages import split_layers
from tandem.parallel import ParallelDims, TPGroup

CONTROL_KEY = "tandem/control"
ROOT_CAUSE_WAIT_S = 2.0  # how long a reported failure waits for the rank that died to show


class MultiprocExecutor:
    """Every rank a worker process on this host (and, with ``nnodes`` > 1, on hosts that
    joined with `run_node`), driven over the control channel."""

    ranks_elsewhere = False  # True: ranks may run on other hosts (TCP rendezvous)
    in_process = False

    def __init__(self, spec: ModelSpec, config: EngineConfig, slot: ReplicaSlot | None = None):
        self.slot = slot or ReplicaSlot()
        dims = config.parallel.dims
        check_layout(spec, config, dims)
        self.max_in_flight = dims.pp
        # past the transport's own timeouts (push_phase_timeout_s): a rank still silent is hung
        self._phase_timeout_s = config.parallel.hung_after_s
        # a step's result: a rank silent this long is hung (SIGSTOP, a livelock), never waited on
        self._step_timeout_s = config.parallel.collective_timeout_s
        self._token = secrets.token_hex(16)
        self._server = ControlServer(config.parallel.master_addr, self._token, dims.world_size)
        self._store = None
        self._tmpdir = None
        if config.parallel.nnodes == 1 and not self.ranks_elsewhere:
            self._tmpdir = tempfile.mkdtemp(prefix="tandem-rdzv-")  # private (0700)
            rendezvous = f"file://{self._tmpdir}/store"
        else:
            default_port = 0 if self.ranks_elsewhere else 29500  # 0: any free port
            self._store = dist.TCPStore(
                config.parallel.master_addr,
                config.parallel.master_port or default_port,
                dims.world_size + 1,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=60),
            )
            host, port = self._server.address
            address = ControlAddress(host, port, self._token, config.dtype)
            self._store.set(CONTROL_KEY, CONTROL.encode(address))
            rendezvous = f"tcp://{config.parallel.master_addr}:{self._store.port}"
        local = dims.world_size // config.parallel.nnodes
        self._procs = self._spawn(
            config, range(local), rendezvous, self._server.address, self._token, spec
        )
        self._finalizer = weakref.finalize(
            self, _release, self._procs, self._server, self._store, self._tmpdir
        )
        try:
            deadline = time.monotonic() + config.parallel.worker_start_timeout_s
            self._server.accept_all(deadline, self.check_alive)
            within = f"worker_start_timeout_s={config.parallel.worker_start_timeout_s:g} s"
            loaded = [self._receive(Capacity, deadline, within) for _ in range(dims.world_size)]
            self.num_blocks = kv_blocks([m.num_blocks for m in loaded])
            self.layouts = sorted((m.layout for m in loaded), key=lambda lay: lay.rank)
            self._server.broadcast(Start(self.num_blocks))
        except BaseException:
            self.shutdown()
            raise

    def submit(self, msg: StepMessage) -> None:
        try:
            self._server.broadcast(msg)
        except PeerGone as exc:
            raise EngineDeadError(self._root_cause(str(exc))) from None

    def apply(self, phase: PushPhase, spec: UpdateSpec, records_by_rank: dict[int, list[Record]]):
        """One phase of a push on every rank: (errors, bytes moved)."""
        try:
            for rank in range(len(self.layouts)):
                records = records_by_rank.get(rank, [])
                self._server.send_to(rank, ApplyWeights(phase, spec, records))
        except PeerGone as exc:
            raise EngineDeadError(self._root_cause(str(exc))) from None
        deadline = time.monotonic() + self._phase_timeout_s  # a hung rank: the engine is dead
        within = f"{self._phase_timeout_s:g} s (push_phase_timeout_s and a margin)"
        results = [self._receive(ApplyResult, deadline, within) for _ in self.layouts]
        return [r.error for r in results if r.error is not None], sum(r.nbytes for r in results)

    def set_kv_cache(self, allocate: bool) -> None:
        try:
            self._server.broadcast(KVCache(allocate))
        except PeerGone as exc:
            raise EngineDeadError(self._root_cause(str(exc))) from None
        for _ in self.layouts:
            self._receive(KVCacheDone, deadline=None)

    def weight_memory(self, msg: WeightMemoryMessage) -> list[str]:
        """Release, restore or reload every rank's parameters: the errors they reported."""
        try:
            self._server.broadcast(msg)
        except PeerGone as exc:
            raise EngineDeadError(self._root_cause(str(exc))) from None
        done = [self._receive(WeightsDone, deadline=None) for _ in self.layouts]
        return [f"rank {d.rank}: {d.error}" for d in done if d.error is not None]

    def collect(self) -> StepResult:
        within = f"collective_timeout_s={self._step_timeout_s:g} s"
        return self._receive(StepResult, time.monotonic() + self._step_timeout_s, within)

    def encode(self, msg: EncodeMessage) -> EncodeResult:
        """Run an encode on every rank (no step in flight); the sampling rank's result."""
        self.submit(msg)
        return self._receive(EncodeResult, deadline=None)

    def score(self, msg: ScoreMessage) -> torch.Tensor:
        """Run a score on every rank (no step in flight): the sampling rank's rows."""
        self.submit(msg)
        return gather_score(msg, iter(lambda: self._receive(ScoreResult, deadline=None), None))

    def _receive(self, kind, deadline: float | None, within: str = ""):
        """The next ``kind`` message from a worker; past ``deadline`` (set by ``within``, the
        setting named in the error) the workers are killed."""
        while True:
            self.check_alive()
            try:
                got = self._server.receive(timeout=0.2)
            except PeerGone as exc:
                raise EngineDeadError(self._root_cause(str(exc))) from None
            if got is not None:
                rank, msg = got
                if not isinstance(msg, kind):
                    raise EngineDeadError(
                        f"rank {rank} sent {type(msg).__name__}, not {kind.__name__}"
                    )
                return msg
            if deadline is not None and time.monotonic() > deadline:
                for proc in self._procs:  # hung: nothing it does now can be trusted
                    proc.kill()
                raise EngineDeadError(
                    f"workers did not report {kind.__name__} within {within} (hung: killed)"
                )

    def check_alive(self) -> None:
        """Raise EngineDeadError if a worker process on this host has exited."""
        if (dead := self._dead()) is not None:
            raise EngineDeadError(dead)

    def _dead(self) -> str | None:
        for i, proc in enumerate(self._procs):
            if proc.poll() is not None:
                rank = getattr(proc, "rank", i)
                return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
        return None

    def _root_cause(self, reported: str) -> str:
        """A rank that dies takes its peers' collectives down with it, and a peer may report
        first: name the rank that died when it shows within a moment."""
        deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
        while time.monotonic() < deadline:
            if (dead := self._dead()) is not None:
                return f"{dead} ({reported})" if dead not in reported else reported
            time.sleep(0.05)
        return reported

    def worker_locations(self) -> list[dict]:
        """Where each local rank runs: ``{rank, node_id, pid}`` (node_id: this host's name)."""
        host = socket.gethostname()
        return [{"rank": r, "node_id": host, "pid": p.pid} for r, p in enumerate(self._procs)]

    def apply_model(self, func) -> list:
        raise NotImplementedError(
            "apply_model runs a function on the model in this process, and this engine's "
            f"{len(self._procs)} ranks are worker processes: tandem sends no code to its "
            "workers (use tensor_parallel_size=1, pipeline_parallel_size=1)"
        )

    def _spawn(self, config, ranks, rendezvous, control_address, token, spec) -> list:
        """Start the ranks' workers: objects with ``pid``, ``poll``, ``wait``, ``terminate``,
        ``kill`` and ``returncode`` (`subprocess.Popen` here)."""
        return spawn_workers(config, ranks, rendezvous, control_address, token, spec, self.slot)

    def shutdown(self) -> None:
        try:
            self._server.broadcast(Shutdown())
        except (PeerGone, OSError):
            pass
        self._finalizer()
        self._store = None


def gather_score(msg: ScoreMessage, parts: Iterator[ScoreResult]) -> torch.Tensor:
    """The rows of ``msg``'s sequences, end to end (float32 [positions, vocab]), from the
    pieces a worker sends in order (`ModelRunner.score`); a piece that does not continue them
    is a broken worker (`EngineDeadError`)."""
    total = sum(len(ids) for ids in msg.seqs)
    out, first = None, 0
    while first < total:
        part = next(parts)
        width = part.width if out is None else out.shape[1]
        if (
            (part.step_id, part.first, part.width) != (msg.step_id, first, width)
            or not 0 < part.rows <= total - first
            or len(part.data) != 4 * part.rows * width
        ):
            raise EngineDeadError(
                f"a score result (step {part.step_id}, rows {part.first}+{part.rows}, "
                f"width {part.width}, {len(part.data)} bytes) does not continue step "
                f"{msg.step_id} at row {first} of {total}"
            )
        if out is None:
            out = torch.empty(total, width, dtype=torch.float32)
        rows = np.frombuffer(part.data, dtype="<f4").reshape(part.rows, width)
        out[first : first + part.rows].numpy()[:] = rows
        first += part.rows
    return out


def check_layout(spec: ModelSpec, config: EngineConfig, dims: ParallelDims) -> None:
    """Fail at start-up, in this process, on sizes that cannot be split."""
    if dims.world_size % config.parallel.nnodes:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size ({dims.world_size}) must be a "
            f"multiple of nnodes ({config.parallel.nnodes})"
        )
    split_layers(spec.num_layers, dims.pp, config.parallel.pipeline_layer_split)
    with torch.device("meta"):
        spec.cls(spec.config, TPGroup(0, dims.tp))  # raises ValueError naming the field


def spawn_workers(
    config, ranks, rendezvous, control_address, token, spec, slot: ReplicaSlot
) -> list[subprocess.Popen]:
    module = spec.cls.__module__
    if module == "__main__":
        raise ValueError(
            f"architecture {spec.architecture} is registered in __main__; worker processes "
            "import models by module, so register it in an importable module"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if config.parallel.nnodes == 1 and sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = config.parallel.worker_start
    if start == "auto":
        start = "fork" if config.torch_device.type == "cpu" else "exec"
    fork = start == "fork" and sys.platform == "linux"
    procs = []
    ranks = list(ranks)
    replicas, replica = slot.size, slot.index
    for local_rank, rank in enumerate(ranks):
        args = WorkerArgs(  # a fleet's replicas share this host's cores and devices
            rank=rank,
            local_rank=replica * len(ranks) + local_rank,
            local_world_size=replicas * len(ranks),
            config=config.model_dump(),
            rendezvous=rendezvous,
            control_host=control_address[0],
            control_port=control_address[1],
            token=token,
            model_modules=[*config.model_modules, module],
        )
        worker_env = {**env, ENV: args.to_env()}
        if fork:
            procs.append(
                start_process(
                    ["-m", WORKER_MODULE],
                    worker_env,
                    preload=(WORKER_MODULE,),
                    exclude=(ENV,),
                    timeout=config.parallel.worker_start_timeout_s,
                )
            )
        else:
            procs.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=worker_env))
    return procs


def _release(procs, server, store, tmpdir) -> None:
    """Stop the workers (politely, then by force) and free ports and files. Idempotent."""
    server.close()  # a worker still waiting for a step sees the connection close and exits
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
    del store  # the rendezvous port closes with the last reference


def run_node(config: EngineConfig, node_rank: int) -> int:
    """Host this node's share of the ranks for an engine on another host (``node_rank`` >= 1).

    Finds the engine through the c10d store at ``master_addr:master_port``, starts the local
    workers in the dtype the engine resolved and returns when they exit (the engine shut down
    or failed)."""
    if not 1 <= node_rank < config.parallel.nnodes:
        raise ValueError(
            f"node_rank must be in [1, {config.parallel.nnodes}) here, got {node_rank}"
        )
    if config.parallel.master_port is None:
        raise ValueError("master_port is required to join an engine on another node")
    dims = config.parallel.dims
    import_model_modules(config.model_modules)
    spec = read_model_spec(config.model, config.quantization)
    check_layout(spec, config, dims)
    store = dist.TCPStore(
        config.parallel.master_addr,
        config.parallel.master_port,
        is_master=False,
        timeout=timedelta(seconds=config.parallel.worker_start_timeout_s),
    )
    control = CONTROL.decode(store.get(CONTROL_KEY))
    if not isinstance(control, ControlAddress):
        raise RuntimeError(f"the engine's store holds {type(control).__name__} at {CONTROL_KEY}")
    if config.dtype not in ("auto", control.dtype):
        raise ValueError(f"dtype {config.dtype!r} given here, the engine runs {control.dtype!r}")
    config = config.model_copy(update={"dtype": control.dtype})
    per_node = dims.world_size // config.parallel.nnodes
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    rendezvous = f"tcp://{config.parallel.master_addr}:{config.parallel.master_port}"
    address = (control.host, control.port)
    # an engine over nodes is one replica: its workers take this host's cores from the first
    procs = spawn_workers(config, ranks, rendezvous, address, control.token, spec, ReplicaSlot())
    del store
    try:
        return max(proc.wait() for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

"""Engine ranks as Ray actors (``distributed_executor_backend="ray"``).

The engine uses the Ray cluster this process is connected to (else ``ray.init(address=
ray_address or "auto")``), reserves one placement group with a bundle per rank (CPUs, plus a
GPU each when ``device`` is CUDA) under ``placement_strategy`` (each replica of a fleet its
own, placed on a node of its own where the cluster has room: `_replica_node`), and runs each
rank's worker (`tandem.engine.worker.main`) inside an actor pinned to its bundle. Everything
else is the multi-process engine's: the same control channel (the actors dial the engine's
control server with its token), the same torch.distributed rendezvous (a TCP store the engine
hosts at ``master_addr``, by default the driver's address as Ray knows it), the same failure
semantics (an actor that dies makes the next call raise `EngineDeadError` naming its rank).
Shutdown stops the actors and removes the placement group.
"""

from __future__ import annotations

import os
import subprocess

from tandem.config import EngineConfig
from tandem.engine.executor import ReplicaSlot
from tandem.engine.multiproc import MultiprocExecutor
from tandem.engine.worker import ENV, WorkerArgs
from tandem.models.loader import ModelSpec


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "distributed_executor_backend='ray' needs Ray: pip install 'tandem-rl[ray]'"
        ) from None
    return ray


NODE_LABEL = "ray.io/node-id"  # every Ray node's own label


def _replica_node(
    ray, config: EngineConfig, slot: ReplicaSlot, ranks: int, bundle: dict
) -> str | None:
    """The node a fleet's replica is placed on, so replicas spread over the cluster: replica r
    takes the r-th (mod their number) of the alive nodes that can hold all its ranks, in node
    id order. None (Ray places it) for a single engine, or when its ranks spread over nodes
    themselves (SPREAD strategies), or when no node can hold them all."""
    if slot.size == 1 or "SPREAD" in config.ray.placement_strategy:
        return None
    fits = sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and all(n["Resources"].get(k, 0) >= v * ranks for k, v in bundle.items())
    )
    return fits[slot.index % len(fits)] if fits else None


class _RankActor:
    """One engine rank: its worker runs in this actor's process."""

    def location(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def run(self, env: dict[str, str]) -> int:
        os.environ.update(env)
        from tandem.engine.worker import main

        return main()


class ActorProcess:
    """A rank's actor seen as a process (what `MultiprocExecutor` waits on and kills)."""

    def __init__(self, actor, rank: int, location: dict):
        self.actor, self.rank = actor, rank
        self.pid, self.node_id = location["pid"], location["node_id"]
        self.returncode: int | None = None
        self._done = None  # the run() call's object ref

    def start(self, env: dict[str, str]) -> None:
        self._done = self.actor.run.remote(env)

    def poll(self) -> int | None:
        ray = _ray()
        if self.returncode is None:
            ready, _ = ray.wait([self._done], timeout=0)
            if ready:
                try:
                    self.returncode = int(ray.get(self._done))
                except Exception:  # the actor died (killed, node lost) or run() raised
                    self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ray = _ray()
        ready, _ = ray.wait([self._done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"rank {self.rank} actor", timeout)
        return self.poll()

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)


class RayExecutor(MultiprocExecutor):
    ranks_elsewhere = True

    def __init__(self, spec: ModelSpec, config: EngineConfig, slot: ReplicaSlot | None = None):
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=config.ray.ray_address or "auto", log_to_driver=False)
        if "master_addr" not in config.parallel.model_fields_set:  # where actors find the driver
            parallel = config.parallel.model_copy(
                update={"master_addr": ray.util.get_node_ip_address()}
            )
            config = config.model_copy(update={"parallel": parallel})
        self._placement = None
        super().__init__(spec, config, slot)

    def _spawn(self, config, ranks, rendezvous, control_address, token, spec) -> list:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks = list(ranks)
        gpus = 1 if config.torch_device.type == "cuda" else 0
        bundle = {"CPU": config.ray.ray_cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        node = _replica_node(ray, config, self.slot, len(ranks), bundle)
        selector = None if node is None else [{NODE_LABEL: node}] * len(ranks)
        self._placement = placement_group(
            [bundle] * len(ranks),
            strategy=config.ray.placement_strategy,
            bundle_label_selector=selector,
        )
        try:
            ray.get(self._placement.ready(), timeout=config.parallel.worker_start_timeout_s)
        except Exception as exc:
            self._remove_placement()
            raise RuntimeError(
                f"Ray could not place {len(ranks)} ranks ({bundle} each, "
                f"{config.ray.placement_strategy}): {exc}"
            ) from None
        actor_cls = ray.remote(num_cpus=bundle["CPU"], num_gpus=gpus)(_RankActor)
        actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=i
                )
            ).remote()
            for i in range(len(ranks))
        ]
        locations = ray.get([a.location.remote() for a in actors])
        procs = [
            ActorProcess(a, r, loc) for a, r, loc in zip(actors, ranks, locations, strict=True)
        ]
        module = spec.cls.__module__
        for proc in procs:
            same_node = [p for p in procs if p.node_id == proc.node_id]
            args = WorkerArgs(
                rank=proc.rank,
                local_rank=same_node.index(proc) if gpus == 0 else 0,
                local_world_size=len(same_node),
                config=config.model_dump(),
                rendezvous=rendezvous,
                control_host=control_address[0],
                control_port=control_address[1],
                token=token,
                model_modules=[*config.model_modules, module],
            )
            env = {ENV: args.to_env()}
            if config.parallel.master_addr.startswith("127."):
                env["GLOO_SOCKET_IFNAME"] = "lo"  # a one-host cluster: keep gloo on loopback
            proc.start(env)
        return procs

    def worker_locations(self) -> list[dict]:
        return [{"rank": p.rank, "node_id": p.node_id, "pid": p.pid} for p in self._procs]

    def shutdown(self) -> None:
        super().shutdown()
        for proc in getattr(self, "_procs", []):
            try:
                proc.kill()
            except Exception:  # already gone
                pass
        self._remove_placement()

    def _remove_placement(self) -> None:
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
            self._placement = None

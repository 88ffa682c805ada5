"""A verl rollout replica served by tandem (``RolloutReplicaRegistry`` entry ``tandem``).

verl makes one replica per ``tp x pp x dp`` of its rollout workers; this one launches its
`TandemServer` actor on the node of its first worker (hybrid and colocated modes: the node
verl's resource pool placed them on) and starts `tandem serve` there with the rollout
config's parallelism. One node per replica: a replica wider than a node is refused.
"""

from __future__ import annotations

from verl.workers.rollout.replica import RolloutReplica

from tandem.integrations.verl import NAME


def server_name(replica_rank: int, node_rank: int = 0) -> str:
    """The named actor a replica's ServerAdapters find their server by (verl's convention)."""
    return f"{NAME}_server_{replica_rank}_{node_rank}"


def model_path(model_config) -> str:
    """The local model directory of verl's model config (a DictConfig or an HFModelConfig)."""
    for field in ("local_path", "path"):
        value = getattr(model_config, field, None)
        if value:
            return str(value)
    raise ValueError("actor_rollout_ref.model.path must name a local Hugging Face directory")


class TandemReplica(RolloutReplica):
    def rollout_worker_use_gpu(self) -> bool:
        import torch

        return torch.cuda.is_available()

    async def launch_servers(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from tandem.integrations.verl.server import TandemServer

        if self.config.enable_rollout_routing_replay:
            raise ValueError(
                "rollout.enable_rollout_routing_replay: verl replays the experts of "
                "every prompt and response position; tandem reports those of "
                "generated tokens only (tandem.rl.replay_routing uses them): not "
                "offered through verl"
            )
        if self.nnodes > 1:
            raise ValueError(
                f"a tandem rollout replica runs on one node; tp x pp x dp = "
                f"{self.world_size} is more than n_gpus_per_node = "
                f"{self.gpus_per_node}"
            )
        if self.workers:
            node = await self.workers[0].__ray_call__.remote(
                lambda worker: ray.get_runtime_context().get_node_id()
            )
        else:
            node = ray.get_runtime_context().get_node_id()
        server = (
            ray.remote(TandemServer)
            .options(
                name=server_name(self.replica_rank) + self.name_suffix,
                num_cpus=0,
                max_concurrency=self.max_concurrency,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            .remote(self.config, model_path(self.model_config), self.replica_rank)
        )
        self._server_address = await server.launch.remote()
        self.servers = [server]
        self._server_handle = server

    async def shutdown(self):
        import ray

        for server in self.servers:
            await server.shutdown.remote()
            ray.kill(server)
        self.servers = []

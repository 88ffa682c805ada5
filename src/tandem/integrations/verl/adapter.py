"""verl's ServerAdapter for tandem (``("tandem", "async")``): in each trainer rank, the bridge
from verl's weight sync and memory calls to the replica's `TandemServer`.

``update_weights(weights, global_steps=...)``: every rank reads verl's whole (name, tensor)
stream (full tensors are gathered collectively: no rank may skip one); the replica's leader
rank (its first rollout rank) sends them, a bucket of
``checkpoint_engine.update_weights_bucket_megabytes`` at a time, through vLLM's
weight-transfer protocol on tandem serve (`tandem.exchange.broadcast_client`): checked on
arrival, committed only when complete, published as version ``global_steps``. At most one
bucket is held beside the trainer's tensors. ``resume(tags)`` / ``release()`` wake the server
up / put it to sleep (with ``free_cache_engine``).

Adapter-only syncs (``peft_config`` with ``base_sync_done``) are refused with a clear error:
tandem takes full (merged) weights, verl's ``lora.merge=True``, until adapter-only sync lands.
"""

from __future__ import annotations

import asyncio
import os

from verl.workers.rollout.base import BaseRollout

from tandem.exchange.broadcast_client import BroadcastClient, Bucket
from tandem.integrations.verl.replica import server_name


class TandemServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        c = self.config
        world = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = replica_rank if replica_rank >= 0 else rank // world
        self.rollout_rank = rank % world  # the replica's first rank sends
        self.is_leader_rank = self.rollout_rank == 0
        self._server = None
        self._client: BroadcastClient | None = None

    def _handle(self):
        import ray

        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._handle().wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._handle().sleep.remote()

    async def update_weights(
        self,
        weights,
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config=None,
        base_sync_done: bool = True,
        **kwargs,
    ):
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise ValueError(f"tandem takes wire_format='named_tensors', got {wire_format!r}")
        if peft_config and base_sync_done:  # LoRA adapters only (verl's vLLM/SGLang rule)
            raise NotImplementedError(
                "tandem's verl rollout takes full weights, not LoRA "
                "adapters: set actor_rollout_ref.model.lora.merge="
                "True"
            )
        stream = ensure_async_iterator(weights)
        if not self.is_leader_rank:
            async for _ in stream:  # the gathers are collective: read them all
                pass
            return
        client = await self._connect()
        bucket = Bucket(client.bucket_bytes)
        try:
            await asyncio.to_thread(client.start)
            async for name, tensor in stream:
                if bucket.add(name, tensor):
                    await asyncio.to_thread(client.send, bucket.take())
            if bucket.tensors:
                await asyncio.to_thread(client.send, bucket.take())
            await asyncio.to_thread(client.finish, global_steps)
        except BaseException:
            client.close()  # a broken group is rebuilt at the next update
            self._client = None
            try:  # the other ranks still gather: read the rest with them, then fail
                async for _ in stream:
                    pass
            except Exception:  # the stream itself broke: nothing left to read
                pass
            raise
        server = self._handle()
        await server.set_global_steps.remote(global_steps)

    async def _connect(self) -> BroadcastClient:
        import ray

        if self._client is None:
            url, key = await self._handle().connection.remote()
            megabytes = self.config.checkpoint_engine.update_weights_bucket_megabytes
            self._client = BroadcastClient(
                url, key, host=ray.util.get_node_ip_address(), bucket_bytes=int(megabytes) << 20
            )
            await asyncio.to_thread(self._client.connect)
        return self._client

"""vLLM's own trainer-side weight-transfer client, pointed at a `tandem serve` (needs vLLM).

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    with gloo_trainer():  # CPU trainers only: vLLM's client speaks NCCL
        engine = WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(master_address=..., master_port=..., world_size=ranks + 1),
            client=TandemWeightSyncClient(url, admin_key), source=ModuleSource(model))
        engine.send_weights()

`TandemWeightSyncClient` is vLLM's `HTTPVLLMWeightSyncClient` sending tandem's admin key (vLLM's
sends no credentials; tandem's weight routes need one). `gloo_trainer` swaps, for the block,
the two names of ``vllm.distributed.weight_transfer.nccl_engine`` that open the trainer's
NCCL communicator and stream its packed buffers on CUDA streams: the group forms through
vLLM's own rendezvous (`StatelessProcessGroup`, the trainer hosting the store) and its
broadcasts run over gloo in the store prefix tandem's ranks join
(`tandem.exchange.transports.broadcast.GROUP_PREFIX`); vLLM's packing (`pack_tensors`), its
HTTP sequence and its metadata are unchanged. On GPUs the NCCL rendezvous pickles NCCL's id
into the store, which tandem does not read: not offered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tandem.exchange.transports.broadcast import broadcast, gloo_group


def _client_base():
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    return HTTPVLLMWeightSyncClient


class _GlooEndpoint:
    """The two methods vLLM's trainer engine calls on its communicator."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.store = store  # keeps the rendezvous alive
        self.group = gloo_group(store, rank, world_size, timeout_s)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if src != 0:
            raise ValueError("the trainer broadcasts from rank 0")
        broadcast(self.group, tensor)

    def destroy(self) -> None:
        self.group = None


@contextmanager
def gloo_trainer(timeout_s: float = 300.0) -> Iterator[None]:
    """vLLM's trainer-side NCCL engine over gloo on CPU, for the block."""
    import vllm.distributed.weight_transfer.nccl_engine as engine
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    def open_endpoint(init_info, rank: int = 0):
        group = StatelessProcessGroup.create(
            host=init_info.master_address,
            port=init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
        )
        return _GlooEndpoint(group.store, rank, init_info.world_size, timeout_s)

    def packed_producer(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        while (chunk := pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
            group.broadcast(chunk.packed_tensor, src=src)

    saved = (
        engine.open_trainer_endpoint,
        engine.packed_nccl_broadcast_producer,
        torch.cuda.current_stream,
    )
    engine.open_trainer_endpoint = open_endpoint
    engine.packed_nccl_broadcast_producer = packed_producer
    if not torch.cuda.is_available():  # the unpacked path asks for a stream it then ignores
        torch.cuda.current_stream = lambda *args, **kwargs: None
    try:
        yield
    finally:
        (
            engine.open_trainer_endpoint,
            engine.packed_nccl_broadcast_producer,
            torch.cuda.current_stream,
        ) = saved


def TandemWeightSyncClient(base_url: str, admin_key: str, timeout: float = 300):  # noqa: N802
    """vLLM's `HTTPVLLMWeightSyncClient` that sends ``Authorization: Bearer <admin_key>``."""
    import requests

    class _Client(_client_base()):
        def _post(self, path: str, json=None) -> None:
            response = requests.post(
                f"{self.base_url}/{path}",
                json=json,
                timeout=self.timeout,
                headers={"Authorization": f"Bearer {admin_key}"},
            )
            if response.status_code >= 400:
                raise requests.HTTPError(
                    f"{response.status_code} {_error(response)}", response=response
                )

    return _Client(base_url, timeout=timeout)


def _error(response) -> str:
    try:
        return json.loads(response.text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text

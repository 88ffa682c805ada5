"""The trainer side of vLLM's ``tandem`` weight-transfer backend, through vLLM's own API, on
every trainer rank::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from tandem.integrations.vllm import TandemTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=rank, world_size=world), client=client,
        source=ModuleSource(model))
    engine.send_weights()          # every step; -> tandem's PushStats
    engine.send_weights(version=3, rollback=True)   # back to an earlier version, on purpose

``client``: vLLM's ``HTTPVLLMWeightSyncClient`` (a ``vllm serve`` with
``--weight-transfer-config '{"backend": "tandem"}'`` and ``VLLM_SERVER_DEV_MODE=1``), its Ray
client, or an offline ``vllm.LLM`` made with ``weight_transfer_config={"backend": "tandem"}``.
Rank 0 drives the client (`ClientTarget`) and serves an exchange that every rank pushes to with
tandem's `WeightSender`: each rank sends its own shard (an FSDP2 module's local shards, a
megatron-core GPTModel rank's TP/PP part; vLLM's backends gather to rank 0) and each vLLM
worker receives only its slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from tandem.errors import StaleVersionError
from tandem.exchange.sender import PushStats, WeightSender
from tandem.integrations.vllm import is_vllm_engine
from tandem.integrations.vllm.client_target import ClientTarget, OfflineClient
from tandem.integrations.vllm.plugin import register

ADDRESS_BYTES = 512  # room for rank 0's exchange address (host:port/token) in a broadcast


@dataclass
class TandemTrainerInitInfo(TrainerInitInfo):
    """``rank`` (keyword, vLLM's field): this trainer rank; ``world_size``: how many trainer
    ranks push (more than one: over torch.distributed's default group, which carries rank 0's
    address to the others); ``transport``: tandem's (`WeightSender`: ``shm`` on one host,
    ``dist`` across hosts; ``auto``: shm); ``host``: where rank 0 listens for vLLM's workers
    and the other trainer ranks; ``verify``: CRC32 every box where it landed; ``vocab_size``:
    the model's real vocabulary where the trainer pads its own (a megatron-core GPTModel, a
    `ModuleSource` like any module): the padding rows are not sent."""

    backend: ClassVar[str] = "tandem"

    world_size: int = 1
    transport: str = "auto"
    host: str = "127.0.0.1"
    verify: bool = True
    timeout_s: float = 600.0
    vocab_size: int | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in 0 .. world_size - 1, got rank={self.rank} "
                f"world_size={self.world_size}"
            )


class TandemTrainerEngine(TrainerWeightTransferEngine[TandemTrainerInitInfo]):
    """One trainer rank's side of the ``tandem`` backend: a `WeightSender` of ``source``'s
    module (its own shard), pushing to the exchange rank 0 serves (`ClientTarget`)."""

    init_info_cls = TandemTrainerInitInfo

    def __init__(
        self, *, client, source, is_sender: bool, sender: WeightSender, target: ClientTarget | None
    ):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.target = target

    @classmethod
    def trainer_init(cls, init_info: TandemTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the tandem backend sends a source: give source=ModuleSource(model)")
        target = address = None
        if init_info.is_sender:
            if is_vllm_engine(client):
                client = OfflineClient(client)
            target = ClientTarget(client, init_info.host, init_info.timeout_s)
            address = target.exchange_address
        if init_info.world_size > 1:
            address = _from_rank0(address)
        sender = WeightSender(
            _pushed(source),
            address,
            transport=init_info.transport,
            verify=init_info.verify,
            rank=init_info.rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            vocab_size=init_info.vocab_size,
        )
        return cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            sender=sender,
            target=target,
        )

    def send_weights(self, version: int | None = None, *, rollback: bool = False) -> PushStats:
        """Push this rank's weights and wait until vLLM's workers committed them (or the push
        failed: `tandem.exchange.WeightSyncError` on every rank, saying whether the old
        version serves or vLLM's weights are torn). ``version``: the one vLLM then reports
        (``finish_weight_update``); None: the one it serves + 1. Versions only go forward: one
        not above the version vLLM's workers serve is refused before any byte moves (by rank
        0's exchange, or by every worker where another trainer pushed since) with
        `tandem.errors.StaleVersionError` naming both, on every rank, the served weights
        untouched; ``rollback=True`` (every rank alike) takes it on purpose. With ``version``
        None, a push refused so (another trainer pushed since rank 0 last knew) goes again
        once, as the version the workers serve + 1."""
        if not isinstance(self.source, ModuleSource | nn.Module):
            self.sender.model = _pushed(self.source)  # a fresh pass over the source
        try:
            stats = self.sender.push(version, rollback=rollback)
        except StaleVersionError:
            if version is not None:
                raise
            stats = self.sender.push(None, rollback=rollback)  # rank 0 learned the version
        if self.sender.world_size > 1:  # rank 0's exchange answers the others after rank 0
            dist.barrier()
        return stats

    def weight_state(self) -> dict:
        """What vLLM serves as rank 0 knows it: ``{"version": v, "torn": reason or None}``."""
        if self.target is None:
            raise ValueError("only trainer rank 0 drives vLLM")
        return self.target.weight_state()

    def shutdown(self) -> None:
        self.sender.close()
        if self.target is not None:
            self.target.close()


def _pushed(source) -> nn.Module | dict[str, torch.Tensor]:
    """What `WeightSender` pushes from ``source``: a `ModuleSource`'s module itself, so each
    rank sends its own FSDP2 shards (iterating the source would gather every tensor); any
    other `WeightSource`'s tensors, as it yields them."""
    if isinstance(source, nn.Module):
        return source
    if isinstance(source, ModuleSource):
        return source._module  # vLLM keeps it private; its iteration would gather
    return {name: tensor.detach() for name, tensor in source}


def _from_rank0(address: str | None) -> str:
    """Rank 0's exchange address on every rank (a broadcast over the default group)."""
    if not dist.is_initialized():
        raise ValueError("world_size > 1 needs torch.distributed's default process group")
    data = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8)
    if address is not None:
        raw = address.encode()
        data[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    return bytes(data[data.nonzero().flatten()].tolist()).decode()


register()  # TandemTrainerInitInfo reaches vLLM's trainer factory even where no plugin ran

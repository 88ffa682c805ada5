"""A live replica in the trainer's role: its ranks' parameters pushed into another replica of
the same fleet (one healing from a fault, or one just added), planned, moved and verified like
any push, never read from the checkpoint on disk. The replica then holds the weights of the
push the peer's came from (`PushHello.copy_of`): a trainer's next delta reaches it too.

The peer's ranks keep their parameters in shared memory (`ParamArena`, engines on CPU): this
process maps them and runs one `WeightSender` per peer rank, whose layout is the rank's own
(`RankLayout`: the same canonical boxes a trainer's layout names), so the planner sends every
box once from the peer rank holding it. Each box's CRC32 is taken as it is read from the peer's
memory and checked where it lands. The receiving replica serves no request meanwhile, so the
push goes straight into its live parameters (``in_place``). The peer goes on serving: nothing
writes its weights while the fleet's push lock is held. A vLLM worker sends the same way
(`RankSender`, ``staged``), over its weights read back from vLLM's layers
(`tandem.integrations.vllm.worker`).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from tandem.dtypes import DTYPES
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.sender import PushStats, WeightSender
from tandem.exchange.transports.memory import MappedArena


class RankSender(WeightSender):
    """One serving rank as a trainer rank: ``layout`` (the canonical boxes in its local
    tensors) as is, ``tensors`` by layout key; its push carries ``copy_of`` (the push those
    weights came from, untouched; None: unknown)."""

    def __init__(
        self,
        layout: RankLayout,
        tensors: dict[str, torch.Tensor],
        world: int,
        target,
        timeout_s: float,
        transport: str,
        admin_key: str | None,
        copy_of: str | None,
        mode: str = "in_place",
    ):
        self._tensors = tensors
        self._layout = RankLayout(
            layout.rank, layout.regions, layout.local_shapes, layout.dtype, dtypes=layout.dtypes
        )
        self._copied = copy_of
        super().__init__(
            tensors,
            target,
            transport=transport,
            mode=mode,
            rank=layout.rank,
            world_size=world,
            timeout_s=timeout_s,
            admin_key=admin_key,
        )

    def _copy_of(self) -> str | None:
        return self._copied

    def _local(self) -> tuple[RankLayout, dict[str, torch.Tensor]]:
        return self._layout, self._tensors


def push_from_peer(
    peer, target, timeout_s: float = 600.0, transport: str = "shm", admin_key: str | None = None
) -> PushStats:
    """Push ``peer``'s weights (an `LLMEngine` serving) into ``target`` (serving no request;
    what `WeightSender` takes: an exchange address, a `tandem serve` URL with ``admin_key``),
    at the peer's version (whatever the target served before: a rollback, in
    `WeightSender.push`'s terms), ``in_place`` over ``transport`` (``shm``: the
    same host; ``dist``: any); the first peer rank's stats. Raises `WeightSyncError` naming
    what failed."""
    layouts = peer.target.weight_layouts()
    missing = [lay.rank for lay in layouts if lay.arena is None]
    if missing:
        raise WeightSyncError(
            f"the peer's ranks {missing} hold no parameters in shared memory "
            "(engines on CPU do): it cannot push to a replica"
        )
    version = peer.weight_version
    # the push the peer's weights came from, untouched: the replica's base from then on, so
    # the trainer's next delta reaches it too (None: they came from elsewhere)
    base = peer.target.weight_base
    # each parameter in its own dtype (block-FP8 values and scales beside the rest); the
    # mappings live as long as the views
    arenas = [MappedArena(lay.arena) for lay in layouts]
    senders = [
        RankSender(
            dataclasses.replace(lay, rank=i),
            {k: arena.param(k, DTYPES[lay.dtype_of(k)]) for k in lay.local_shapes},
            len(layouts),
            target,
            timeout_s,
            transport,
            admin_key,
            base,
        )
        for i, (lay, arena) in enumerate(zip(layouts, arenas, strict=True))
    ]
    results: list = [None] * len(senders)

    def one(i: int) -> None:
        try:
            # a copy of the peer's version, never news: it may equal the replica's (one just
            # added, or torn by a push at its version) or, after a rollback, lie below it
            results[i] = senders[i].push(version, rollback=True, delta=False)
        except BaseException as exc:
            results[i] = exc

    threads = [
        threading.Thread(target=one, args=(i,), name=f"tandem-peer-rank-{i}", daemon=True)
        for i in range(1, len(senders))
    ]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join(timeout_s)
    for sender in senders:
        sender.close()
    errors = [f"peer rank {i}: {r}" for i, r in enumerate(results) if not isinstance(r, PushStats)]
    if errors:
        raise WeightSyncError("; ".join(errors))
    return results[0]

"""Subprocesses of `tandem bench sync`; each prints one JSON line with its figures.

    python -m tandem.bench.sync_worker raw-gloo RANK PORT STREAMS REPEATS MESSAGE_BYTES
    python -m tandem.bench.sync_worker raw-mooncake RANK PORT STREAMS REPEATS
    python -m tandem.bench.sync_worker naive RANK PORT DIR REPEATS broadcast|isend
    python -m tandem.bench.sync_worker planner quick|full

``raw-gloo`` (STREAMS: a JSON matrix of bytes per sender and receiver, world size senders +
receivers) and ``naive`` (world size 4: 2 trainer ranks, 2 engine ranks) rendezvous on
127.0.0.1:PORT over gloo; every rank uses one torch thread. tandem's own pushes run in
`tandem.bench.sync_pushes`.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.distributed as dist


def _rounds(senders: int, receivers: int) -> list[tuple[int, int]]:
    """Every (sender, receiver) stream in the push's order (`stream_order` in
    `tandem.exchange.transports.p2p`): round k pairs sender s with receiver
    (s + k) mod max(senders, receivers); within a round, by sender."""
    span = max(senders, receivers)
    pairs = [(s, d) for s in range(senders) for d in range(receivers)]
    return sorted(pairs, key=lambda sd: ((sd[1] - sd[0]) % span, sd[0]))


def _messages(buf: torch.Tensor, message_bytes: int) -> list[torch.Tensor]:
    """``buf`` as the messages it travels in: whole (``message_bytes`` 0) or in pieces."""
    return list(buf.split(message_bytes)) if message_bytes else [buf]


def _message_ends(nbytes: int, message_bytes: int) -> torch.Tensor:
    """The first and last byte of every message of a stream of ``nbytes`` bytes."""
    step = message_bytes or nbytes
    firsts = torch.arange(0, nbytes, step)
    lasts = torch.clamp(firsts + step, max=nbytes) - 1
    return torch.cat([firsts, lasts])


def raw_gloo(rank: int, port: str, streams: list[list[int]], repeats: int, message_bytes: int):
    """Ranks [0, S) send, [S, S + R) receive (S, R: the matrix's rows and columns); stream
    (s, d) is ``streams[s][d]`` bytes from one preallocated, pre-touched uint8 tensor into
    another. Each rank walks its streams in the push's round order, one at a time: it posts the
    stream's messages (isend / irecv), waits for them, then starts the next. Receivers time
    from the barrier to their last message landing and check that every message's first and
    last byte came from the right sender."""
    senders, receivers = len(streams), len(streams[0])
    sending = rank < senders
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=senders + receivers
    )
    me = rank if sending else rank - senders
    mine = [
        (s, d)
        for s, d in _rounds(senders, receivers)
        if (s if sending else d) == me and streams[s][d]
    ]
    bufs = []
    for s, d in mine:
        buf = torch.empty(streams[s][d], dtype=torch.uint8)
        buf.fill_(s + 1 if sending else 0)  # the sender's mark; every page touched
        bufs.append(buf)
    ends = [_message_ends(buf.numel(), message_bytes) for buf in bufs]
    seconds = []
    for i in range(1 + repeats):  # the first is a warm-up (connections, buffers)
        if not sending:
            for buf, at in zip(bufs, ends, strict=True):
                buf[at] = 0  # so the check below sees this run's bytes
        dist.barrier()
        start = time.perf_counter()
        for (s, d), buf in zip(mine, bufs, strict=True):
            if sending:
                works = [dist.isend(m, senders + d) for m in _messages(buf, message_bytes)]
            else:
                works = [dist.irecv(m, s) for m in _messages(buf, message_bytes)]
            for work in works:
                work.wait()
        if i:
            seconds.append(time.perf_counter() - start)
        for (s, _), buf, at in zip(mine, bufs, ends, strict=True) if not sending else ():
            if not bool((buf[at] == s + 1).all()):
                raise RuntimeError(f"rank {rank} did not receive sender {s}'s bytes")
    if not sending:
        _emit(rank=rank, seconds=seconds, nbytes=sum(buf.numel() for buf in bufs))
    dist.barrier()
    dist.destroy_process_group()


def raw_mooncake(rank: int, port: str, streams: list[list[int]], repeats: int):
    """Mooncake's own transfer of the mooncake push's bytes, as that push moves them: ranks
    [0, S) register one buffer each holding their streams to every receiver one after
    another; ranks [S, S + R) register one buffer each and read stream (s, d) from sender s
    with one batched one-sided read per sender, senders in turn (the push's receive). gloo
    only passes the handles and times the runs (barrier to the slowest receiver's last
    read); receivers check every stream's first and last byte came from its sender."""
    from tandem.exchange.transports.mooncake import ProcessEngine, RegisteredBuffer

    senders, receivers = len(streams), len(streams[0])
    sending = rank < senders
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=senders + receivers
    )
    engine = ProcessEngine.get()
    me = rank if sending else rank - senders
    size = sum(streams[me]) if sending else sum(row[me] for row in streams)
    registered = RegisteredBuffer()
    buf = registered.at_least(size)
    buf.fill_(me + 1 if sending else 0)  # the sender's mark; every page touched
    host, rpc_port = engine.segment.rsplit(":", 1)
    handle = torch.tensor([int(rpc_port), registered.address if sending else 0])
    handles = [torch.zeros(2, dtype=torch.int64) for _ in range(senders + receivers)]
    dist.all_gather(handles, handle)
    seconds = []
    for i in range(1 + repeats):  # the first is a warm-up (connections)
        if not sending:
            buf.zero_()
        dist.barrier()
        start = time.perf_counter()
        if not sending:
            at, ends = 0, []
            for s in range(senders):
                n = streams[s][me]
                if not n:
                    continue
                rpc, remote = handles[s].tolist()
                offset = sum(streams[s][:me])
                rc = engine.engine.batch_transfer_sync_read(
                    f"{host}:{rpc}", [buf.data_ptr() + at], [remote + offset], [n]
                )
                if rc != 0:
                    raise RuntimeError(f"rank {rank}: reading from sender {s} failed: {rc}")
                ends.append((s, at, at + n - 1))
                at += n
            if i:
                seconds.append(time.perf_counter() - start)
            for s, first, last in ends:
                if not (buf[first] == buf[last] == s + 1):
                    raise RuntimeError(f"rank {rank} did not read sender {s}'s bytes")
        dist.barrier()
    if not sending:
        _emit(rank=rank, seconds=seconds, nbytes=size)
    dist.barrier()
    registered.release()
    dist.destroy_process_group()


# ranks of `naive`: 0, 1 the FSDP2 trainer, then the engine ranks (replica by replica)
NAIVE_TRAINERS = [0, 1]


def naive(
    rank: int, port: str, model_dir: str, repeats: int, send: str, replicas: int = 1, tp: int = 2
):
    """The in-memory path RL stacks take: the 2 FSDP2 trainer ranks (`NAIVE_TRAINERS`) and
    ``replicas`` x ``tp`` engine ranks in one gloo group. Per push, trainer rank 0 gathers every
    parameter (``full_tensor()``, rank 1 joins) and sends the full tensor to every engine rank
    (``send``: ``broadcast`` in the group of rank 0 and every engine rank, or ``isend`` to each,
    replica after replica), tensor by tensor; each engine rank receives it into a preallocated
    buffer and copies its tensor-parallel part into its parameters through their pieces
    (load_weights-style)."""
    torch.set_num_threads(1)
    engine_ranks = list(range(len(NAIVE_TRAINERS), len(NAIVE_TRAINERS) + replicas * tp))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=len(NAIVE_TRAINERS) + len(engine_ranks),
    )
    # every rank creates every group, in the same order
    trainers = dist.new_group(NAIVE_TRAINERS)
    replica_groups = [dist.new_group(engine_ranks[r * tp : (r + 1) * tp]) for r in range(replicas)]
    fanout = dist.new_group([NAIVE_TRAINERS[0], *engine_ranks])
    if rank in NAIVE_TRAINERS:
        _naive_trainer(rank, trainers, fanout, engine_ranks, model_dir, repeats, send)
    else:
        index = engine_ranks.index(rank)
        replica = replica_groups[index // tp]
        _naive_engine(rank, replica, index % tp, tp, fanout, model_dir, repeats, send)
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_model(model_dir: str, group: dist.ProcessGroup) -> torch.nn.Module:
    """The model, FSDP2-sharded over ``group``'s ranks (every layer, then the root)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    mesh = DeviceMesh.from_group(group, "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _naive_trainer(
    rank: int, trainers, fanout, engine_ranks: list[int], model_dir: str, repeats: int, send: str
):
    """Gather and send (rank 0) or join the gathers (rank 1): one untimed push, ``repeats``
    timed, one untimed for the engine's check. Rank 0 reports each push's gathering time."""
    params = dict(_fsdp_model(model_dir, trainers).named_parameters())
    sender = rank == NAIVE_TRAINERS[0]
    if sender:  # what follows, so the engine ranks can preallocate (untimed)
        header = [
            [n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in params.items()
        ]
        _broadcast_bytes(json.dumps(header).encode(), fanout)
    seconds, gathers, nbytes = [], [], 0
    with torch.no_grad():
        for i in range(repeats + 2):  # a warm-up, the timed pushes, the check's push
            dist.barrier()
            start, gathering, nbytes = time.perf_counter(), 0.0, 0
            for p in params.values():
                at = time.perf_counter()
                full = p.full_tensor()
                gathering += time.perf_counter() - at
                nbytes += full.numel() * full.element_size()
                if sender:
                    _fan_out(full.contiguous(), fanout, engine_ranks, send)
            if 0 < i <= repeats:
                seconds.append(time.perf_counter() - start)
                gathers.append(gathering)
    if sender:
        _emit(rank=rank, seconds=seconds, gather_seconds=gathers, state_dict_bytes=nbytes)


def _fan_out(full: torch.Tensor, fanout, engine_ranks: list[int], send: str) -> None:
    """Rank 0 sends one full tensor to every engine rank."""
    if send == "broadcast":
        dist.broadcast(full, src=NAIVE_TRAINERS[0], group=fanout)
    else:
        for work in [dist.isend(full, dst) for dst in engine_ranks]:
            work.wait()


def _naive_engine(
    rank: int, engine, tp_rank: int, tp: int, fanout, model_dir: str, repeats: int, send: str
):
    """This engine rank's tensor-parallel model (random storage, no KV cache); per push every
    full tensor is received into one preallocated buffer and its pieces copied into the
    parameters. Reports each timed push's seconds (barrier to the last copy); after them, one
    more push is checked piece by piece against the parameters."""
    from tandem.layers.placement import unique_parameters
    from tandem.models.loader import build_model, read_model_spec
    from tandem.parallel import TPGroup

    spec = read_model_spec(model_dir)
    model = build_model(spec, TPGroup(tp_rank, tp, engine), torch.float32, "cpu")
    index: dict[str, list] = {}  # canonical name -> [(param, piece)] that read it
    for param in unique_parameters(model):
        for piece in param.pieces:
            index.setdefault(piece.name, []).append((param, piece))
    header = json.loads(_broadcast_bytes(None, fanout))
    if {n for n, _, _ in header} != set(index) or {d for _, _, d in header} != {"float32"}:
        raise RuntimeError(f"rank {rank}: the trainer's tensors do not match the engine's")
    buf = torch.zeros(max(math.prod(shape) for _, shape, _ in header), dtype=torch.float32)
    seconds, checked = [], 0
    with torch.no_grad():
        for param in unique_parameters(model):
            param.fill_(float("nan"))  # nothing passes the check unless a push wrote it
        for i in range(repeats + 2):  # a warm-up, the timed pushes, the check's push
            dist.barrier()
            start = time.perf_counter()
            for name, shape, _ in header:
                full = buf[: math.prod(shape)].view(shape)
                if send == "broadcast":
                    dist.broadcast(full, src=NAIVE_TRAINERS[0], group=fanout)
                else:
                    dist.recv(full, src=NAIVE_TRAINERS[0])
                for param, piece in index.get(name, ()):
                    if i <= repeats:
                        piece.write(param, full[piece.box_slices()])
                    else:
                        checked += _check_piece(rank, param, piece, full)
            if 0 < i <= repeats:
                seconds.append(time.perf_counter() - start)
    _emit(rank=rank, seconds=seconds, checked_pieces=checked)


def _check_piece(rank: int, param: torch.Tensor, piece, full: torch.Tensor) -> int:
    """1 if ``param`` holds ``piece``'s box of the full tensor just received; raises if not."""
    if not torch.equal(piece.region().view(param), full[piece.box_slices()]):
        raise RuntimeError(f"rank {rank}: {piece.name} box {piece.box} was not written")
    return 1


def _broadcast_bytes(data: bytes | None, group) -> bytes:
    """Trainer rank 0 sends ``data`` (length first) to the rest of ``group``; all return it."""
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=NAIVE_TRAINERS[0], group=group)
    if data is None:
        buf = torch.empty(int(size), dtype=torch.uint8)
    else:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=NAIVE_TRAINERS[0], group=group)
    return bytes(buf.numpy())


def planner(scale: str):
    """Plan the MoE layouts (`tandem.bench.moe_layout`) once, timed; report the plan's balance
    and the best balance any plan could reach for these layouts."""
    import gc
    import resource

    from tandem.bench.moe_layout import FULL_MOE, QUICK_MOE, moe_layouts
    from tandem.exchange.plan import plan_transfers

    shape = {"full": FULL_MOE, "quick": QUICK_MOE}[scale]
    start = time.perf_counter()
    senders, receivers = moe_layouts(shape)
    built = time.perf_counter() - start
    gc.collect()
    start = time.perf_counter()
    plan = plan_transfers(senders, receivers)
    seconds = time.perf_counter() - start
    # A pipeline stage's tensors live only on its EP ranks: at best a stage's load is spread
    # evenly over them.
    stage_load = [
        sum(plan.sender_numel[s * shape.ep : (s + 1) * shape.ep]) / shape.ep
        for s in range(shape.pp)
    ]
    # and a sender alone sends the elements no other sender holds
    bound = max(*stage_load, *_sole_loads(senders, plan))
    mean = plan.total_numel / len(plan.sender_numel)
    _emit(
        seconds=seconds,
        transfers=len(plan.transfers),
        sender_max_over_mean=plan.sender_max_over_mean,
        bound_max_over_mean=bound / mean,
        build_seconds=built,
        sender_regions=sum(len(s.regions) for s in senders),
        receiver_regions=sum(len(r.regions) for r in receivers),
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _sole_loads(senders, plan) -> list[int]:
    """Per sender, the elements of ``plan``'s transfers no other sender holds: every plan
    sends them from that sender. (A transfer's box never straddles a sender region's edge:
    the planner cuts receiver boxes along them.)"""
    holders: dict[str, dict[tuple, set[int]]] = {}
    for lay in senders:
        for region in lay.regions:
            boxes = holders.setdefault(region.piece.name, {})
            boxes.setdefault(region.piece.box, set()).add(lay.rank)
    # only tensors with a box a single sender holds can have sole elements
    solo = {
        name: list(boxes.items())
        for name, boxes in holders.items()
        if any(len(ranks) == 1 for ranks in boxes.values())
    }
    load = [0] * plan.num_senders
    for t in plan.transfers:
        boxes = solo.get(t.name)
        if boxes is None:
            continue
        ranks = set().union(*(ranks for box, ranks in boxes if _contains(box, t.box)))
        if len(ranks) == 1:
            load[t.src] += t.numel
    return load


def _contains(outer: tuple, inner: tuple) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    what, *args = argv
    if what == "raw-gloo":
        rank, port, streams, repeats, message_bytes = args
        raw_gloo(int(rank), port, json.loads(streams), int(repeats), int(message_bytes))
    elif what == "raw-mooncake":
        rank, port, streams, repeats = args
        raw_mooncake(int(rank), port, json.loads(streams), int(repeats))
    elif what == "naive":
        rank, port, model_dir, repeats, send, replicas, tp = args
        naive(int(rank), port, model_dir, int(repeats), send, int(replicas), int(tp))
    elif what == "planner":
        planner(*args)
    else:
        print(f"unknown command {what!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

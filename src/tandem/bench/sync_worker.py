"""Subprocesses of `tandem bench sync`; each prints one JSON line with its figures.

    python -m tandem.bench.sync_worker push RANK PORT DIR ADDRESS REPEATS [MODE,...]
    python -m tandem.bench.sync_worker raw-gloo RANK PORT NBYTES REPEATS
    python -m tandem.bench.sync_worker naive RANK PORT DIR PATH REPEATS
    python -m tandem.bench.sync_worker planner quick|full

``push`` and ``naive`` are 2-rank FSDP2 trainers over gloo (world size 2, rendezvous on
127.0.0.1:PORT); every rank uses one torch thread. ``push`` runs each MODE (see `MODES`;
default ``shm``) in turn: one untimed push, then REPEATS timed ones, versions counting up from 1.
With ``TANDEM_BENCH_SYNC_PROFILE=DIR`` the timed pushes of each mode and rank are profiled
(cProfile) into DIR/push-MODE-rankRANK.prof.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def _trainer(rank: int, port: str, model_dir: str) -> torch.nn.Module:
    """The model, FSDP2-sharded over both ranks (every layer, then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# mode -> WeightSender options; each mode gets one untimed push, then REPEATS timed ones
MODES = {
    "shm": {"transport": "shm"},
    "shm-unverified": {"transport": "shm", "verify": False},  # no CRC32 on either side
    "shm-in_place": {"transport": "shm", "mode": "in_place"},
    "shm-in_place-unverified": {"transport": "shm", "mode": "in_place", "verify": False},
    "dist": {"transport": "dist", "mode": "staged"},
    "dist-in_place": {"transport": "dist", "mode": "in_place"},
    "dist-in_place-unverified": {"transport": "dist", "mode": "in_place", "verify": False},
}


def push(rank: int, port: str, model_dir: str, address: str, repeats: int, modes: str = "shm"):
    from tandem.exchange import WeightSender

    model = _trainer(rank, port, model_dir)
    profile_dir = os.environ.get("TANDEM_BENCH_SYNC_PROFILE")
    version, out = 0, {}
    for name in modes.split(","):
        sender = WeightSender(model, address, **MODES[name])
        dist.barrier()
        version += 1
        warm = sender.push(version=version)  # plans, caches, joins groups
        profiler = None
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            version += 1
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            stats = sender.push(version=version)
            seconds.append(time.perf_counter() - start)
            if profiler is not None:
                profiler.disable()
        if profiler is not None:
            profiler.dump_stats(os.path.join(profile_dir, f"push-{name}-rank{rank}.prof"))
        out[name] = {"seconds": seconds, "warmup_seconds": warm.seconds, "version": stats.version,
                     "bytes_sent": stats.bytes_sent, "bytes_needed": stats.bytes_needed,
                     "bytes_moved": stats.bytes_moved, "transport": stats.transport}  # fmt: skip
    dist.barrier()
    _emit(rank=rank, pushes=version, modes=out)
    dist.destroy_process_group()


def raw_gloo(rank: int, port: str, nbytes: int, repeats: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(rank + 1)  # touch every page before timing
    seconds = []
    for i in range(1 + repeats):  # the first is a warm-up (connections, buffers)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)
        if i:
            seconds.append(time.perf_counter() - start)
    if rank == 1:
        if int(buf[0]) != 1 or int(buf[-1]) != 1:
            raise RuntimeError("rank 1 did not receive rank 0's bytes")
        _emit(rank=rank, seconds=seconds, nbytes=nbytes)
    dist.barrier()
    dist.destroy_process_group()


def naive(rank: int, port: str, model_dir: str, path: str, repeats: int):
    model = _trainer(rank, port, model_dir)
    seconds, nbytes = [], 0
    for i in range(1 + repeats):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        state = {name: p.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(state, path)
        if i:
            seconds.append(time.perf_counter() - start)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        del state
    dist.barrier()
    if rank == 0:
        _emit(rank=rank, seconds=seconds, state_dict_bytes=nbytes, file_bytes=os.path.getsize(path))
    dist.destroy_process_group()


def planner(scale: str):
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
    # A pipeline stage's tensors live only on its EP ranks: the best any plan can do is to
    # spread each stage's load evenly over them.
    stage_load = [sum(plan.sender_numel[s * shape.ep : (s + 1) * shape.ep]) / shape.ep
                  for s in range(shape.pp)]  # fmt: skip
    mean = plan.total_numel / len(plan.sender_numel)
    _emit(seconds=seconds, transfers=len(plan.transfers),
          sender_max_over_mean=plan.sender_max_over_mean,
          stage_bound_max_over_mean=max(stage_load) / mean, build_seconds=built,
          sender_regions=sum(len(s.regions) for s in senders),
          receiver_regions=sum(len(r.regions) for r in receivers),
          max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    what, *args = argv
    if what == "push":
        rank, port, model_dir, address, repeats, *modes = args
        push(int(rank), port, model_dir, address, int(repeats), *modes)
    elif what == "raw-gloo":
        rank, port, nbytes, repeats = args
        raw_gloo(int(rank), port, int(nbytes), int(repeats))
    elif what == "naive":
        rank, port, model_dir, path, repeats = args
        naive(int(rank), port, model_dir, path, int(repeats))
    elif what == "planner":
        planner(*args)
    else:
        print(f"unknown command {what!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

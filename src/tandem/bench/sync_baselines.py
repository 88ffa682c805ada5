"""The baselines `tandem bench sync` measures next to tandem's pushes (memcpy, raw gloo streams
shaped like the dist push, the naive in-memory gather/send/load path, the planner at scale),
and the worker processes that run them (`tandem.bench.sync_worker`). See `tandem.bench.sync`
for what each one times."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tandem.bench.moe_layout import FULL_MOE, QUICK_MOE
from tandem.wire import free_port

REPEATS = 3


def gib_per_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / (1 << 30), 3)


# see sync_worker.MODES
def memcpy(nbytes: int) -> dict[str, Any]:
    """The floor for moving ``nbytes`` once through memory: the faster of torch's ``copy_``
    (its intra-op threads) and a copy storing past the cache (`tandem.kernels.copy`, the
    bytes split between a thread per core), each best of ``REPEATS``."""
    from tandem.kernels import copy as kernels

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)  # every page touched before timing
    cores = len(os.sched_getaffinity(0))
    cut = [nbytes * i // cores // 64 * 64 for i in range(cores)] + [nbytes]

    def streamed() -> None:
        parts = [
            threading.Thread(target=kernels.copy, args=(src[a:b], dst[a:b], True))
            for a, b in zip(cut, cut[1:], strict=False)
        ]
        for t in parts:
            t.start()
        for t in parts:
            t.join()

    copies = {"torch_copy": lambda: dst.copy_(src)}
    if kernels.available():
        copies["streaming_copy"] = streamed
    out: dict[str, Any] = {}
    for name, run in copies.items():
        dst.fill_(0)
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        if int(dst[0]) != 7 or int(dst[-1]) != 7:
            raise RuntimeError(f"memcpy baseline ({name}) did not copy")
        out[f"{name}_seconds"] = round(min(seconds), 6)
    method = min(copies, key=lambda name: out[f"{name}_seconds"])
    best = out[f"{method}_seconds"]
    return {
        "seconds": best,
        "gib_per_s": gib_per_s(nbytes, best),
        "bytes": nbytes,
        "method": method,
        **out,
        "threads": {"torch_copy": torch.get_num_threads(), "streaming_copy": cores},
        "timing": f"best of {REPEATS} each; seconds: the faster",
    }


def best_sitting(*sittings: dict[str, Any]) -> dict[str, Any]:
    """The fastest of a baseline's measurements at different times in the run (each a dict
    with ``seconds``), with every sitting's ``seconds`` beside it."""
    best = dict(min(sittings, key=lambda s: s["seconds"]))
    best["seconds_per_sitting"] = [s["seconds"] for s in sittings]
    return best


def cpu_rates(nbytes: int) -> dict[str, Any]:
    """What a core does to bytes, for the link model (`tandem.scale.local`): a copy, a CRC32
    and a checked copy (the sender's write: each piece's CRC32 as read, the piece then copied),
    each as the pushes do them (`tandem.exchange.checksum`), of ``nbytes`` contiguous bytes,
    on one thread and on every core at once (a thread per core, each on its own buffers),
    best of ``REPEATS``; bytes per second."""
    from tandem.exchange.checksum import checked_copy, tensor_crc32

    cores = len(os.sched_getaffinity(0))
    pairs = []
    for _ in range(cores):
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(7)
        dst.fill_(0)  # every page touched before timing
        pairs.append((src, dst))
    ops = {
        "copy": lambda src, dst: checked_copy(src, dst, False),
        "crc": lambda src, dst: tensor_crc32(src),
        "checked_copy": lambda src, dst: checked_copy(src, dst, True),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"bytes": nbytes, "cores": cores, "timing": f"best of {REPEATS}"}
    try:
        for name, op in ops.items():
            for label, k in (("one", 1), ("all", cores)):
                best = math.inf
                for _ in range(REPEATS):
                    workers_ = [threading.Thread(target=op, args=pairs[i]) for i in range(k)]
                    start = time.perf_counter()
                    for w in workers_:
                        w.start()
                    for w in workers_:
                        w.join()
                    best = min(best, time.perf_counter() - start)
                out[f"{name}_{label}_Bps"] = round(k * nbytes / best)
    finally:
        torch.set_num_threads(threads)
    if int(pairs[0][1][-1]) != 7:
        raise RuntimeError("copy rate did not copy")
    return out


# raw_gloo sends each stream as one message (0) rather than in the push's 4 MiB messages: on
# the 2-core bench VM the two were within noise of each other (best of 3 runs of 570.5 MB each:
# 0.084 / 0.107 / 0.109 s whole, 0.131 / 0.101 / 0.107 s in 4 MiB messages)
RAW_GLOO_MESSAGE_BYTES = 0
RAW_GLOO_NOTE = (
    "each stream is sent as one message: 4 MiB messages (the push's) measured the same within noise"
)


def raw_gloo(
    streams: list[list[int]], timeout: float, message_bytes: int = RAW_GLOO_MESSAGE_BYTES
) -> dict[str, Any]:
    """Point-to-point gloo shaped like the dist push: ``streams[s][d]`` bytes from sender s to
    receiver d, senders and receivers in their own processes (see `sync_worker.raw_gloo`). A
    run is the slowest receiver's time; the best run counts."""
    port, spec = str(free_port()), json.dumps(streams)
    world = len(streams) + len(streams[0])
    argv = [
        ["raw-gloo", str(r), port, spec, str(REPEATS), str(message_bytes)] for r in range(world)
    ]
    messages = f"{message_bytes >> 20} MiB messages" if message_bytes else "one message a stream"
    timing = f"receiver's last message; streams in the push's rounds, {messages}"
    return _raw_runs("raw gloo", streams, workers(argv, timeout), timing)


def raw_mooncake(streams: list[list[int]], timeout: float) -> dict[str, Any]:
    """Mooncake's own one-sided reads of the mooncake push's streams (``streams[s][d]`` bytes
    of sender s read by receiver d), each rank in its own process (`sync_worker.raw_mooncake`):
    a run is the slowest receiver's time; the best run counts."""
    port, spec = str(free_port()), json.dumps(streams)
    world = len(streams) + len(streams[0])
    argv = [["raw-mooncake", str(r), port, spec, str(REPEATS)] for r in range(world)]
    return _raw_runs(
        "raw mooncake",
        streams,
        workers(argv, timeout),
        "receiver's last read; one batched read per (sender, receiver), TCP on loopback",
    )


def _raw_runs(
    what: str, streams: list[list[int]], ranks: list[dict[str, Any]], timing: str
) -> dict[str, Any]:
    """A raw baseline's figures from its ranks' reports (senders first, then receivers): a
    run is its slowest receiver's time, the best run counts; every byte must have arrived."""
    receivers = ranks[len(streams) :]
    per_run = [max(r["seconds"][i] for r in receivers) for i in range(REPEATS)]
    best, nbytes = min(per_run), sum(map(sum, streams))
    if sum(r["nbytes"] for r in receivers) != nbytes:
        raise RuntimeError(f"{what} receivers got {[r['nbytes'] for r in receivers]} bytes")
    return {
        "seconds": round(best, 6),
        "gib_per_s": gib_per_s(nbytes, best),
        "bytes": nbytes,
        "streams": streams,
        "seconds_per_run": [round(s, 6) for s in per_run],
        "timing": f"best of {REPEATS} after a warm-up; a run is the barrier to the slowest "
        + timing,
    }


# naive: rank 0 sends each full tensor with one gloo broadcast to the engine ranks (as verl,
# OpenRLHF and vLLM's update_weights broadcast over NCCL), or "isend": an isend to each. On the
# 2-core bench VM the two were within noise (3 runs of 544 MiB each: broadcast 1.148 / 1.105 /
# 1.001 s, isend 1.088 / 1.154 / 1.084 s), so naive keeps what RL stacks do.
NAIVE_SEND = "broadcast"
NAIVE_NOTE = (
    "rank 0 sends each tensor with one gloo broadcast, as RL stacks do (over NCCL); an isend "
    "to each engine rank measured the same within noise"
)


def naive(
    path: Path, timeout: float, send: str = NAIVE_SEND, replicas: int = 1, tp: int = 2
) -> dict[str, Any]:
    """The in-memory path RL stacks take, trainer and engine ranks in one gloo group (see
    `sync_worker.naive`): a push is the barrier to the slowest engine rank's last copy."""
    port = str(free_port())
    ranks = 2 + replicas * tp
    argv = [
        ["naive", str(r), port, str(path), str(REPEATS), send, str(replicas), str(tp)]
        for r in range(ranks)
    ]
    rank0, _, *engine = workers(argv, timeout)
    per_push = [max(r["seconds"][i] for r in engine) for i in range(REPEATS)]
    best, nbytes = min(per_push), rank0["state_dict_bytes"]
    how = "one gloo broadcast to" if send == "broadcast" else "an isend to each of"
    fleet = f"{replicas} replicas x TP {tp}" if replicas > 1 else f"TP {tp}"
    return {
        "seconds": round(best, 6),
        "gib_per_s": gib_per_s(nbytes, best),
        "gather_seconds": round(min(rank0["gather_seconds"]), 6),
        "state_dict_bytes": nbytes,
        "seconds_per_push": [round(s, 6) for s in per_push],
        "checked_pieces": [r["checked_pieces"] for r in engine],
        "method": f"trainer rank 0 gathers each parameter (full_tensor) and sends it by {how} "
        f"the {replicas * tp} engine ranks ({fleet}), which copy their shards into their "
        "parameters (param.pieces)",
        "timing": f"best of {REPEATS} pushes after a warm-up; a push is the barrier to the "
        "slowest engine rank's last copy; gather_seconds: rank 0's full_tensor calls, best push",
    }


def planner(quick: bool, timeout: float) -> dict[str, Any]:
    shape = QUICK_MOE if quick else FULL_MOE
    out: dict[str, Any] = {
        "trainer_ranks": shape.trainer_ranks,
        "engine_ranks": shape.engine_ranks,
        "params": shape.params(),
        "shape": asdict(shape),
        "trainer": f"PP {shape.pp} x EP {shape.ep}; dense tensors replicated on a stage's EP ranks",
        "engine": f"experts: EP {shape.experts} x expert-TP {shape.expert_tp}; attention: TP "
        f"{shape.attn_tp} x DP {shape.engine_ranks // shape.attn_tp}",
    }
    try:
        (got,) = workers([["planner", "quick" if quick else "full"]], timeout)
    except TimeoutError:
        return {
            "seconds": None,
            "transfers": None,
            "sender_max_over_mean": None,
            "bound_max_over_mean": None,
            "max_over_bound": None,
            "timeout_s": timeout,
            **out,
        }
    return {
        "seconds": round(got["seconds"], 3),
        "sender_max_over_mean": round(got["sender_max_over_mean"], 4),
        # no plan does better: a stage's load stays on its own EP ranks, and what only one
        # sender holds is sent by it
        "bound_max_over_mean": round(got["bound_max_over_mean"], 4),
        "max_over_bound": round(got["sender_max_over_mean"] / got["bound_max_over_mean"], 4),
        "transfers": got["transfers"],
        "build_seconds": round(got["build_seconds"], 3),
        "sender_regions": got["sender_regions"],
        "receiver_regions": got["receiver_regions"],
        "max_rss_bytes": got["max_rss_bytes"],
        **out,
    }


def workers(argvs: list[list[str]], timeout: float) -> list[dict[str, Any]]:
    """Run ``python -m tandem.bench.sync_worker ARGV`` per entry at once; each one's last JSON
    line (None if it printed none). Any failure or the timeout kills them all."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for argv in argvs:
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            logs.append((out, err))
            cmd = [sys.executable, "-m", "tandem.bench.sync_worker", *argv]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [(i, p) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                i, p = failed[0]
                raise RuntimeError(
                    f"bench worker {argvs[i][:2]} exited with {p.returncode}:\n{tail(logs[i][1])}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench workers {[a[:2] for a in argvs]} ran past {timeout} s")
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(
                    f"bench worker {argvs[i][:2]} exited with {p.returncode}:\n{tail(logs[i][1])}"
                )
        return [_last_json(out) for out, _ in logs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in logs:
            out.close()
            err.close()


def tail(f, limit: int = 4000) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")[-limit:]


def _last_json(f) -> dict[str, Any] | None:
    f.seek(0)
    lines = [line for line in f.read().decode(errors="replace").splitlines() if line[:1] == "{"]
    return json.loads(lines[-1]) if lines else None

"""The baselines `tandem bench sync` measures next to tandem's pushes (memcpy, one raw gloo
send, the naive gather/save/load path, the planner at scale), and the worker processes that run
them (`tandem.bench.sync_worker`). See `tandem.bench.sync` for what each one times."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tandem.bench.moe_layout import FULL_MOE, QUICK_MOE

REPEATS = 3
SHM_DIR = Path("/dev/shm")


def gib_per_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / (1 << 30), 3)


# see sync_worker.MODES
def memcpy(nbytes: int) -> dict[str, Any]:
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)  # every page touched before timing
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    if int(dst[-1]) != 7:
        raise RuntimeError("memcpy baseline did not copy")
    best = min(seconds)
    return {"seconds": round(best, 6), "gib_per_s": gib_per_s(nbytes, best), "bytes": nbytes,
            "threads": torch.get_num_threads(), "timing": f"best of {REPEATS}"}  # fmt: skip


def raw_gloo(nbytes: int, timeout: float) -> dict[str, Any]:
    port = str(free_port())
    argv = [["raw-gloo", str(r), port, str(nbytes), str(REPEATS)] for r in (0, 1)]
    ranks = workers(argv, timeout)
    best = min(ranks[1]["seconds"])
    return {"seconds": round(best, 6), "gib_per_s": gib_per_s(nbytes, best), "bytes": nbytes,
            "timing": f"best of {REPEATS} after a warm-up, timed on the receiver"}  # fmt: skip


def naive(path: Path, timeout: float) -> dict[str, Any]:
    file = SHM_DIR / f"tandem-bench-naive-{secrets.token_hex(8)}.pt"
    try:
        port = str(free_port())
        argv = [["naive", str(r), port, str(path), str(file), str(REPEATS)] for r in (0, 1)]
        rank0 = workers(argv, timeout)[0]
        state = torch.load(file, weights_only=True)  # warm-up, and the shapes to preallocate
        dst = {name: torch.empty_like(t) for name, t in state.items()}
        for name, t in state.items():
            dst[name].copy_(t)  # every page touched before timing
        del state
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            state = torch.load(file, weights_only=True)
            for name, t in state.items():
                dst[name].copy_(t)
            seconds.append(time.perf_counter() - start)
            del state
    finally:
        file.unlink(missing_ok=True)
    gather_save, load_copy = min(rank0["seconds"]), min(seconds)
    total = gather_save + load_copy
    return {
        "seconds": round(total, 6),
        "gib_per_s": gib_per_s(rank0["state_dict_bytes"], total),
        "gather_save_seconds": round(gather_save, 6),
        "load_copy_seconds": round(load_copy, 6),
        "state_dict_bytes": rank0["state_dict_bytes"],
        "file_bytes": rank0["file_bytes"],
        "timing": f"best gather+save (rank 0) + best load+copy, {REPEATS} each after a warm-up",
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
        return {"seconds": None, "transfers": None, "sender_max_over_mean": None,
                "timeout_s": timeout, **out}  # fmt: skip
    return {
        "seconds": round(got["seconds"], 3),
        "sender_max_over_mean": round(got["sender_max_over_mean"], 4),
        # the least max/mean any plan reaches: a stage's load can only go to its own EP ranks
        "stage_bound_max_over_mean": round(got["stage_bound_max_over_mean"], 4),
        "transfers": got["transfers"],
        "build_seconds": round(got["build_seconds"], 3),
        "sender_regions": got["sender_regions"],
        "receiver_regions": got["receiver_regions"],
        "max_rss_bytes": got["max_rss_bytes"],
        **out,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                    f"bench worker {argvs[i][:2]} exited with {p.returncode}:\n{_tail(logs[i][1])}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench workers {[a[:2] for a in argvs]} ran past {timeout} s")
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(
                    f"bench worker {argvs[i][:2]} exited with {p.returncode}:\n{_tail(logs[i][1])}"
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


def _tail(f, limit: int = 4000) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")[-limit:]


def _last_json(f) -> dict[str, Any] | None:
    f.seek(0)
    lines = [line for line in f.read().decode(errors="replace").splitlines() if line[:1] == "{"]
    return json.loads(lines[-1]) if lines else None

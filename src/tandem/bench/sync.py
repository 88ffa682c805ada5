"""`tandem bench sync`: how fast a trainer's weights land in a live engine, against baselines.

Measured in one run, on this host, on the same bytes:

- ``shm``: 2 FSDP2 trainer processes (gloo, ``torch.distributed`` on CPU) each call
  ``WeightSender(model, llm.exchange_address).push(version)`` into an
  ``LLM(tensor_parallel_size=2)`` in this process: one untimed push (plans, caches, maps), then
  ``REPEATS`` timed ones. A push's time is its wall time on the slowest trainer rank (staging,
  CRC32s, the engine's verify and commit on both of its ranks); the best push counts. ``shm``
  is the default ``staged`` mode, ``shm_in_place`` is ``mode="in_place"`` (the trainer ranks
  write straight into the engine's shared parameters); ``unverified_seconds``: the same pushes
  with ``verify=False`` (no CRC32 on either side).
- ``gloo`` / ``gloo_in_place``: the same trainer processes push with ``transport="dist"``
  (trainer and engine ranks in one gloo group, point to point), ``staged`` / ``in_place``.
- ``memcpy``: ``dst.copy_(src)`` of two preallocated uint8 tensors of ``bytes_needed`` bytes in
  this process, best of ``REPEATS``: the floor for moving those bytes once through memory.
- ``raw_gloo``: ``dist.send`` of one uint8 tensor of ``bytes_needed`` bytes from one process to
  another over gloo (TCP on loopback), best of ``REPEATS`` after a warm-up: the floor for a
  torch.distributed transport on CPU.
- ``naive``: what RL stacks do today: the FSDP2 trainers gather the full state dict on rank 0
  (``p.full_tensor()`` per parameter) and ``torch.save`` it to a file in ``/dev/shm``; this
  process ``torch.load``s it (``weights_only=True``) and copies every tensor into preallocated
  tensors of the same shapes (a stand-in for the engine's ``load_state_dict``; a tensor-parallel
  engine would also have to split each tensor, so this is a lower bound). Best gather+save plus
  best load+copy, ``REPEATS`` each after a warm-up.
- ``planner``: `tandem.exchange.plan.plan_transfers` on metadata-only layouts (no tensors) of a
  1T-parameter MoE, 1024 trainer ranks -> 512 engine ranks (see `tandem.bench.moe_layout`),
  timed once in a subprocess (one core: the planner is pure Python).

``--quick`` uses a model of a few MiB and a small MoE layout, so the run takes seconds.
"""

from __future__ import annotations

import json
import math
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
from tandem.models.tiny import make_tiny_model

# ~544 MiB of float32 weights (142.6M parameters); the exact bytes are reported.
FULL_MODEL: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
QUICK_MODEL: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
# quick -> (model dir, config overrides, vocab size)
SETUPS: dict[bool, tuple[str, dict[str, Any], int]] = {
    False: (".tandem/bench-sync", FULL_MODEL, 32000),
    True: (".tandem/bench-sync-quick", QUICK_MODEL, 2048),
}
REPEATS = 3
KV_CACHE_MEMORY = 64 << 20
SHM_DIR = Path("/dev/shm")


def run(quick: bool = False) -> dict[str, Any]:
    """Build (or reuse) the model, measure tandem's push and every baseline, return figures."""
    try:
        import transformers  # noqa: F401  (the trainer processes load the model with it)
    except ImportError:
        raise RuntimeError(
            "tandem bench sync runs FSDP2 trainers built with transformers, which is not "
            "installed; install the test extra: pip install -e '.[test]'"
        ) from None
    from tandem import LLM

    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = round(now - clock, 2)
        clock = now

    model_dir, overrides, vocab = SETUPS[quick]
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama", seed=0, vocab_size=vocab, overrides=overrides)
    config = json.loads((path / "config.json").read_text())
    params, weight_bytes = _weights(path)
    lap("model")
    timeout = 120.0 if quick else 600.0
    result: dict[str, Any] = {
        "benchmark": "sync",
        "quick": quick,
        "model": {
            "params": params,
            "bytes": weight_bytes,
            "hidden": config["hidden_size"],
            "intermediate": config["intermediate_size"],
            "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"],
            "vocab": config["vocab_size"],
            "dtype": "float32",
        },
        "trainer": {
            "ranks": 2,
            "sharding": "FSDP2 (fully_shard per layer, then the root)",
            "backend": "gloo",
            "threads_per_rank": 1,
        },
        "engine": {"tensor_parallel_size": 2, "kv_cache_memory": KV_CACHE_MEMORY},
        "threads": torch.get_num_threads(),
        "repeats": REPEATS,
    }
    with LLM(str(path), tensor_parallel_size=2, kv_cache_memory=KV_CACHE_MEMORY) as llm:
        lap("engine_start")
        pushes = _pushes(llm, path, timeout)
    lap("pushes")
    shm, shm_direct = pushes["shm"], pushes["shm-in_place"]
    shm["mode"], shm_direct["mode"] = "staged", "in_place"
    shm["unverified_seconds"] = pushes["shm-unverified"]["seconds"]  # verify=False: no CRC32s
    shm_direct["unverified_seconds"] = pushes["shm-in_place-unverified"]["seconds"]
    gloo, gloo_direct = pushes["dist"], pushes["dist-in_place"]
    gloo["mode"], gloo_direct["mode"] = "staged", "in_place"
    needed = shm["bytes_needed"]
    if any(p["bytes_needed"] != needed for p in pushes.values()):
        raise RuntimeError(f"push modes disagree on bytes_needed: {pushes}")
    result["shm"] = shm
    result["shm_in_place"] = shm_direct
    result["gloo"] = gloo
    result["gloo_in_place"] = gloo_direct
    result["memcpy"] = _memcpy(needed)
    lap("memcpy")
    result["raw_gloo"] = _raw_gloo(needed, timeout)
    lap("raw_gloo")
    result["naive"] = _naive(path, timeout)
    lap("naive")
    result["bytes_moved_over_needed"] = max(p["bytes_moved"] for p in pushes.values()) / needed
    result["planner"] = _planner(quick, timeout=120.0 if quick else PLANNER_TIMEOUT_S)
    lap("planner")
    result["phase_seconds"] = phases  # wall time of each part of this run, processes included
    planner_s = result["planner"]["seconds"]
    memcpy, raw = result["memcpy"]["seconds"], result["raw_gloo"]["seconds"]
    result["ratios"] = {
        "shm_vs_memcpy": round(memcpy / shm_direct["seconds"], 3),
        "gloo_vs_raw_gloo": round(raw / gloo_direct["seconds"], 3),
        "vs_naive": round(result["naive"]["seconds"] / shm["seconds"], 3),
        "shm_staged_vs_memcpy": round(memcpy / shm["seconds"], 3),
        "gloo_staged_vs_raw_gloo": round(raw / gloo["seconds"], 3),
        "shm_unverified_vs_memcpy": round(memcpy / shm_direct["unverified_seconds"], 3),
    }
    result["notes"] = [
        "shm_vs_memcpy and gloo_vs_raw_gloo time mode='in_place' (the one-copy paths: trainer "
        "ranks write into the engine's shared parameters / the engine receives into them), with "
        "CRC32 verification on; *_staged_* time the default mode='staged'; vs_naive uses shm "
        "staged. shm_unverified_vs_memcpy: in_place with verify=False.",
        "naive's load+copy fills preallocated tensors of the full shapes; a tensor-parallel "
        "engine would also split every tensor, so naive is a lower bound.",
    ]
    if planner_s is None:
        result["notes"].append(
            f"the planner did not finish within {result['planner']['timeout_s']} s; "
            "planner.seconds is null"
        )
    return result


PLANNER_TIMEOUT_S = 450.0


def _weights(path: Path) -> tuple[int, int]:
    """(parameters, bytes) of the model's safetensors files, from their headers."""
    params = nbytes = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, stop = entry["data_offsets"]
            nbytes += stop - start
            params += math.prod(entry["shape"])
    return params, nbytes


def _gib_per_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / (1 << 30), 3)


# see sync_worker.MODES
PUSH_MODES = ("shm", "shm-unverified", "shm-in_place", "shm-in_place-unverified", "dist",
              "dist-in_place")  # fmt: skip


def _pushes(llm, path: Path, timeout: float) -> dict[str, dict[str, Any]]:
    """Every push mode in turn by the same 2 trainer processes: figures per mode."""
    port = str(_free_port())
    modes = ",".join(PUSH_MODES)
    argv = [["push", str(r), port, str(path), llm.exchange_address, str(REPEATS), modes]
            for r in (0, 1)]  # fmt: skip
    ranks = _workers(argv, timeout)
    if llm.weight_version != ranks[0]["pushes"]:
        raise RuntimeError(f"engine at version {llm.weight_version}, pushed {ranks[0]['pushes']}")
    return {mode: _push_figures([r["modes"][mode] for r in ranks]) for mode in PUSH_MODES}


def _push_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_push = [max(r["seconds"][i] for r in ranks) for i in range(REPEATS)]  # slowest rank
    best = min(per_push)
    first = ranks[0]
    if any((r["bytes_needed"], r["bytes_moved"]) != (first["bytes_needed"], first["bytes_moved"])
           for r in ranks):  # fmt: skip
        raise RuntimeError(f"trainer ranks disagree on the bytes: {ranks}")
    return {
        "seconds": round(best, 6),
        "gib_per_s": _gib_per_s(first["bytes_needed"], best),
        "bytes_needed": first["bytes_needed"],
        "bytes_moved": first["bytes_moved"],
        "bytes_sent_per_rank": [r["bytes_sent"] for r in ranks],
        "seconds_per_push": [round(s, 6) for s in per_push],
        "warmup_seconds": round(max(r["warmup_seconds"] for r in ranks), 4),
        "transport": first["transport"],
        "timing": f"best of {REPEATS} pushes after a warm-up; a push is its slowest rank's time",
    }


def _memcpy(nbytes: int) -> dict[str, Any]:
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
    return {"seconds": round(best, 6), "gib_per_s": _gib_per_s(nbytes, best), "bytes": nbytes,
            "threads": torch.get_num_threads(), "timing": f"best of {REPEATS}"}  # fmt: skip


def _raw_gloo(nbytes: int, timeout: float) -> dict[str, Any]:
    port = str(_free_port())
    argv = [["raw-gloo", str(r), port, str(nbytes), str(REPEATS)] for r in (0, 1)]
    ranks = _workers(argv, timeout)
    best = min(ranks[1]["seconds"])
    return {"seconds": round(best, 6), "gib_per_s": _gib_per_s(nbytes, best), "bytes": nbytes,
            "timing": f"best of {REPEATS} after a warm-up, timed on the receiver"}  # fmt: skip


def _naive(path: Path, timeout: float) -> dict[str, Any]:
    file = SHM_DIR / f"tandem-bench-naive-{secrets.token_hex(8)}.pt"
    try:
        port = str(_free_port())
        argv = [["naive", str(r), port, str(path), str(file), str(REPEATS)] for r in (0, 1)]
        rank0 = _workers(argv, timeout)[0]
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
        "gib_per_s": _gib_per_s(rank0["state_dict_bytes"], total),
        "gather_save_seconds": round(gather_save, 6),
        "load_copy_seconds": round(load_copy, 6),
        "state_dict_bytes": rank0["state_dict_bytes"],
        "file_bytes": rank0["file_bytes"],
        "timing": f"best gather+save (rank 0) + best load+copy, {REPEATS} each after a warm-up",
    }


def _planner(quick: bool, timeout: float) -> dict[str, Any]:
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
        (got,) = _workers([["planner", "quick" if quick else "full"]], timeout)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workers(argvs: list[list[str]], timeout: float) -> list[dict[str, Any]]:
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


def summary(result: dict[str, Any]) -> str:
    """The ratios (null ones marked n/a) and the headline figures, one per line."""
    lines = [f"{k}: {'n/a' if v is None else f'{v:.2f}x'}" for k, v in result["ratios"].items()]
    shm, planner = result["shm"], result["planner"]
    lines.append(f"shm push: {shm['seconds']:.3f} s, {shm['gib_per_s']:.2f} GiB/s")
    lines.append(f"bytes_moved_over_needed: {result['bytes_moved_over_needed']:.3f}")
    seconds = "did not finish" if planner["seconds"] is None else f"{planner['seconds']:.1f} s"
    lines.append(f"planner ({planner['trainer_ranks']} -> {planner['engine_ranks']} ranks): "
                 f"{seconds}")  # fmt: skip
    return "\n".join(lines)

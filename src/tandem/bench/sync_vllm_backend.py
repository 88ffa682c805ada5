"""`tandem bench sync --into vllm`'s weight-transfer backend pushes: tandem as vLLM's ``tandem``
backend against vLLM's own dense ``nccl`` engine, both through vLLM's trainer API.

Per backend, one ``vllm serve`` (vLLM's venv, TP=2, one core per worker, eager, float32,
``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend": ...}'``) and the 2 FSDP2
trainer ranks of `tandem bench sync` (gloo, one thread each) in vLLM's venv, each calling
``WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
source=ModuleSource(model))`` once, then ``send_weights()`` per push
(`tandem.bench.sync_vllm_backend_engine.trainer_main`): one untimed push, then ``REPEATS``
timed ones, each of new weights (scaled as in `tandem.bench.sync_pushes`) and each checked,
untimed, by this process against transformers (the server's greedy completion's tokens and
log-probs). A push's seconds: the slowest trainer rank's ``send_weights()``, which returns once
vLLM's ``finish_weight_update`` answered.

- ``tandem``: ``TandemTrainerInitInfo(rank, world_size=2)``: each rank sends its own shards,
  each worker receives its slices, CRC32-verified, staged, committed in place.
- ``nccl``: vLLM's ``nccl`` engine cannot run on this CPU-only host
  (`NCCL_UNAVAILABLE` says why); ``nccl_gloo`` is that engine with its
  communicator over gloo and its CUDA stream calls left out (one-by-one mode), nothing else
  changed: every rank iterates ``ModuleSource`` (``full_tensor()`` gathers), rank 0 broadcasts
  each full tensor to every worker, which loads it through vLLM's layerwise reload.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tandem.bench.generate_vllm import serve_command, serve_env, stop_group
from tandem.bench.sync_baselines import REPEATS, gib_per_s, tail
from tandem.bench.sync_pushes import (
    NEW_TOKENS,
    PROMPT,
    Reference,
    drive_trainers,
    scored,
    trainer_env,
)
from tandem.wire import free_port

BACKENDS = {"tandem": "tandem", "nccl": "nccl_gloo"}  # the figures' key -> vLLM's backend
EXTENSION = "tandem.bench.sync_vllm_backend_engine.NcclOverGloo"
ENGINE = "tandem.bench.sync_vllm_backend_engine"
# why vLLM's own backends do not run on this CPU-only host (vLLM 0.32's CPU build, as raised)
NCCL_UNAVAILABLE = {
    "group setup": "torch.accelerator.current_device_index(): Cannot access accelerator "
    "device when none is available",
    "PyNcclCommunicator": "vllm.utils.nccl.find_nccl_library: NCCL only supports CUDA and "
    "ROCm backends",
    "packed mode": "packed_tensor runs on torch.cuda.Stream",
    "one-by-one mode": "torch.cuda.current_stream(): Torch not compiled with CUDA enabled",
    "update_weights": "torch.accelerator.synchronize(): Cannot access accelerator device "
    "when none is available",
    "nccl_m2n": "No module named 'nccl' (nccl.m2n.reshard, NCCL's resharding collective)",
    "ipc": "CUDA IPC handles (torch.cuda)",
    "sharded_rdt": "No module named 'nixl' (NIXL pulls)",
    "sparse_nccl": "NCCL, and TP=1/PP=1 only",
}


class Server:
    """A ``vllm serve`` (TP=``tp``) with weight-transfer backend ``backend``; a context
    manager."""

    def __init__(self, python: Path, model_dir: Path, tp: int, backend: str, log, timeout: float):
        cores = sorted(os.sched_getaffinity(0))[:tp]  # one per worker
        env = serve_env(python, "|".join(map(str, cores)))
        port = free_port()
        cmd = serve_command(
            python,
            model_dir,
            port,
            32 << 20,
            *("--tensor-parallel-size", str(tp)),
            *("--weight-transfer-config", json.dumps({"backend": backend})),
        )
        if backend != "tandem":
            cmd += ["--worker-extension-cls", EXTENSION]
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        began = time.monotonic()
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            while not _healthy(self.url):
                if self.process.poll() is not None or time.monotonic() - began > timeout:
                    raise RuntimeError(f"vllm serve did not come up:\n{tail(log)}")
                time.sleep(1)  # polling its health route
            self.model = _get(self.url + "/v1/models")["data"][0]["id"]
        except BaseException:
            self.close()
            raise
        self.load_seconds = round(time.monotonic() - began, 2)

    def complete(self) -> tuple[list[int], list[float]]:
        body = {
            "model": self.model,
            "prompt": PROMPT,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def close(self) -> None:
        stop_group(self.process)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def push_through(
    python: Path, model_dir: Path, server: Server, backend: str, timeout: float
) -> dict[str, Any]:
    """The 2 trainer ranks pushing ``1 + REPEATS`` times into ``server`` through vLLM's trainer
    API with ``backend``, each push checked: both ranks' figures and the checks."""
    port, group_port = str(free_port()), str(free_port())
    env = trainer_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    args = [port, str(model_dir), server.url, backend, group_port, str(1 + REPEATS)]
    reference, errors = Reference(model_dir), []

    def pushed(event: dict) -> None:
        reference.advance_to(event["scalings"])
        tokens, logprobs = server.complete()
        errors.append(scored(reference, tokens, logprobs, None, None))

    commands = [[str(python), "-m", ENGINE, str(rank), *args] for rank in (0, 1)]
    rank0, rank1 = drive_trainers(
        commands,
        env,
        timeout,
        pushed,
        f"{backend} trainer",
        lambda: f"\nvllm serve:\n{tail(server.log)}",
    )
    return {"ranks": [rank0, rank1], "errors": errors}


def figures(backend: str, pushed: dict[str, Any], weight_bytes: int) -> dict[str, Any]:
    """Seconds per verified push (slowest rank; untimed first push left out) and the bytes
    into each worker."""
    ranks = pushed["ranks"]
    per_push = [max(r["seconds"][i] for r in ranks) for i in range(1, 1 + REPEATS)]
    median = statistics.median(per_push)
    out: dict[str, Any] = {
        "seconds": round(median, 6),
        "best_seconds": round(min(per_push), 6),
        "seconds_per_push": [round(s, 6) for s in per_push],
        "warmup_seconds": round(max(r["seconds"][0] for r in ranks), 6),
        "trainer_init_seconds": round(max(r["init_seconds"] for r in ranks), 3),
        "pushes_checked": len(pushed["errors"]),
        "max_abs_logprob_error": max(pushed["errors"]),
    }
    if backend == "tandem":
        by_worker = [sum(col) for col in zip(*(r["bytes_by_receiver"] for r in ranks), strict=True)]
        out.update(
            bytes_into_each_worker=by_worker,
            bytes_needed=ranks[0]["bytes_needed"],
            bytes_moved=ranks[0]["bytes_moved"],
            bytes_sent_by_rank=[r["bytes_sent"] for r in ranks],
            transport=ranks[0]["transport"],
        )
    else:
        sent = ranks[0]["bytes_broadcast"]  # a broadcast: each worker receives every byte
        out.update(bytes_into_each_worker=[sent, sent], bytes_sent_by_rank=[sent, 0])
    out["gib_per_s"] = gib_per_s(sum(out["bytes_into_each_worker"]), median)
    out["vs_model_bytes"] = [round(b / weight_bytes, 4) for b in out["bytes_into_each_worker"]]
    return out


def run(python: Path, model_dir: Path, weight_bytes: int, timeout: float) -> dict[str, Any]:
    """Both backends, one server each (in turn): the JSON keys ``backend_tandem``,
    ``backend_vllm_nccl`` and the vLLM backends that do not run here."""
    result: dict[str, Any] = {}
    for key, backend in BACKENDS.items():
        with tempfile.TemporaryFile() as log:
            with Server(python, model_dir, 2, backend, log, timeout) as server:
                pushed = push_through(python, model_dir, server, backend, timeout)
                side = figures(key, pushed, weight_bytes)
                side["vllm_load_seconds"] = server.load_seconds
        side["backend"] = backend
        result[f"backend_{'tandem' if key == 'tandem' else 'vllm_nccl'}"] = side
    result["backend_tandem"]["how"] = (
        "vLLM's trainer API, backend tandem: TandemTrainerInitInfo(rank, world_size=2) on both "
        "FSDP2 ranks, HTTPVLLMWeightSyncClient into vllm serve (TP=2); each rank sends its own "
        "shards (shm), each worker receives its slices, CRC32-verified, staged, committed"
    )
    result["backend_vllm_nccl"]["how"] = (
        "vLLM 0.32's dense nccl engine (NCCLTrainerWeightTransferEngine / "
        "NCCLWeightTransferEngine), run as is but for its communicator, a gloo group (trainer "
        "rank 0 + 2 workers) with PyNcclCommunicator's broadcast, its one-by-one mode "
        "(packed=False: packed runs on CUDA streams) and no CUDA stream/synchronize calls; "
        "vLLM's trainer API on both FSDP2 ranks (rank 1 joins the full_tensor() gathers), "
        "HTTPVLLMWeightSyncClient into vllm serve (TP=2), layerwise reload + load_weights"
    )
    result["vllm_backends_not_runnable_here"] = NCCL_UNAVAILABLE
    return result

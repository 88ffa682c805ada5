"""`tandem bench sync --into vllm`: a trainer's weights into a running vLLM engine, tandem's
push against vLLM's own update path, on the same model and trainer as `tandem bench sync`.

Measured in one run, on this host:

- ``into_tandem``: the 2 FSDP2 trainer processes of `tandem bench sync` push
  (``WeightSender``, shm, staged, verified) into ``LLM(tensor_parallel_size=2)`` here; one
  untimed push, then ``REPEATS`` timed ones, each checked (`tandem.bench.sync_pushes`).
- ``into_vllm``: the same trainers push, the same way, into vLLM's CPU build at
  ``tensor_parallel_size=2`` (one core per worker), run by vLLM's venv with tandem's worker
  extension (`tandem.bench.sync_vllm_host`); ``unverified_seconds``: with ``verify=False``;
  ``into_vllm_dist``: ``transport="dist"``. After every push, untimed, vLLM's greedy log-probs
  are checked against transformers on the trainer's weights.
- ``load_weights``: vLLM's own path as RL frameworks use it with a trainer in processes of its
  own: the same trainers gather every full tensor (``full_tensor()``), rank 0 sends them over
  gloo to vLLM's process, which hands them to every worker by ``collective_rpc`` into its
  ``reload_weights`` and answers; timed on the trainers like a push, checked the same way.
- ``load_weights_in_process``: that path at its best: the full tensors already in vLLM's
  process (their gathering and sending not counted), only the ``collective_rpc`` into
  ``reload_weights`` timed; one untimed, then ``REPEATS`` timed, each checked.

- ``backend_tandem`` and ``backend_vllm_nccl``: through vLLM's own trainer API into a ``vllm
  serve`` (TP=2) each, the same 2 trainer ranks calling ``send_weights()``: tandem as vLLM's
  ``tandem`` weight-transfer backend against vLLM's dense ``nccl`` engine, which cannot run on
  this CPU-only host as shipped and runs here with its communicator over gloo
  (`tandem.bench.sync_vllm_backend`; ``vllm_backends_not_runnable_here`` says why each of
  vLLM's backends does not run); seconds per checked push (median of ``REPEATS``) and the
  bytes into each worker.

``ratios.into_vllm_vs_load_weights`` = load_weights / into_vllm seconds (best of each);
``into_vllm_vs_load_weights_in_process`` likewise; ``into_vllm_vs_into_tandem`` = into_tandem /
into_vllm; ``tandem_backend_vs_vllm_nccl`` = backend_vllm_nccl / backend_tandem seconds
(medians), ``tandem_backend_worker_bytes_vs_vllm_nccl`` their bytes into each worker (target:
``TARGET`` times vLLM's best runnable backend, each worker only its slices).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench import sync_baselines as base
from tandem.bench import sync_vllm_backend
from tandem.bench.generate_vllm import vllm_env, vllm_python
from tandem.bench.sync import KV_CACHE_MEMORY, bench_model, push_figures, weights_of
from tandem.bench.sync_baselines import REPEATS
from tandem.bench.sync_pushes import (
    GATHERED,
    NEW_TOKENS,
    PROMPT,
    Reference,
    check,
    run_pushes,
    scored,
)
from tandem.wire import free_port

VLLM_MODES = ("shm", "shm-unverified", "dist")
TARGET = 2.0  # the tandem backend's push against vLLM's best runnable backend's, TP=2


class VllmHost:
    """`tandem.bench.sync_vllm_host` in vLLM's venv; use as a context manager."""

    def __init__(self, python: Path, model_dir: Path, tp: int, log):
        # the engine core in the host process, as TRL's colocate mode runs it: collective_rpc
        # then hands tensors to the workers through vLLM's shared-memory broadcast (across
        # the engine core's own process boundary its msgpack decodes them as plain lists)
        cores = sorted(os.sched_getaffinity(0))[:tp]  # one per worker
        env = vllm_env(
            python,
            "|".join(map(str, cores)),
            VLLM_CPU_CI_ENV="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
        self.log = log
        self.process = subprocess.Popen(
            [str(python), "-m", "tandem.bench.sync_vllm_host"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            self.started = self.ask("start", model=str(model_dir), tp=tp)
        except BaseException:
            self.close()
            raise

    def ask(self, kind: str, **args) -> dict[str, Any]:
        self.process.stdin.write(json.dumps({kind: args}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM host exited during {kind!r}:\n{base.tail(self.log)}")
        return json.loads(line)

    def check(self, reference: Reference, version: int | None) -> float:
        got = self.ask("generate", prompt=PROMPT, max_tokens=NEW_TOKENS)
        served = got["version"] if version is not None else None
        return scored(reference, got["tokens"], got["logprobs"], served, version)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()

    def __enter__(self) -> VllmHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run(quick: bool = False) -> dict[str, Any]:
    from tandem import LLM

    python = vllm_python()
    if python is None:
        raise RuntimeError("tandem bench sync --into vllm needs vLLM's venv: make vllm")
    path = bench_model(quick)
    params, weight_bytes = weights_of(path)
    timeout = 120.0 if quick else 600.0
    result: dict[str, Any] = {
        "benchmark": "sync_into_vllm",
        "quick": quick,
        "model": {"dir": str(path), "params": params, "bytes": weight_bytes, "dtype": "float32"},
        "trainer": {"ranks": 2, "sharding": "FSDP2", "backend": "gloo", "threads_per_rank": 1},
        "engines": {"tensor_parallel_size": 2},
        "repeats": REPEATS,
    }
    with LLM(
        str(path), tensor_parallel_size=2, kv_cache_memory=KV_CACHE_MEMORY, dtype="float32"
    ) as llm:
        ranks, _ = run_pushes(
            llm.exchange_address,
            path,
            REPEATS,
            timeout,
            lambda ref, v: check(llm, ref, v),
            ("shm",),
        )
    result["into_tandem"] = push_figures(ranks["shm"])
    with tempfile.TemporaryFile() as log, VllmHost(python, path, 2, log) as host:
        result["vllm_load_seconds"] = host.started["load_seconds"]
        ranks, result["checks"] = run_pushes(
            host.started["address"], path, REPEATS, timeout, host.check, VLLM_MODES
        )
        pushes = {mode: push_figures(per_rank) for mode, per_rank in ranks.items()}
        into = result["into_vllm"] = pushes["shm"]
        into["unverified_seconds"] = pushes["shm-unverified"]["seconds"]
        result["into_vllm_dist"] = pushes["dist"]
        reference = Reference(path)
        scalings, seconds, errors = result["checks"]["scalings"], [], []
        for i in range(1 + REPEATS):  # the first untimed, as for the pushes
            scalings += 1
            took = host.ask("load_weights", scalings=scalings)["seconds"]
            reference.advance_to(scalings)
            errors.append(host.check(reference, None))
            if i:
                seconds.append(took)
        result["load_weights_in_process"] = {
            "seconds": round(min(seconds), 6),
            "seconds_per_push": [round(s, 6) for s in seconds],
            "gib_per_s": base.gib_per_s(into["bytes_needed"], min(seconds)),
            "max_abs_logprob_error": max(errors),
            "how": (
                "collective_rpc('reload_weights', weights_iterator=full tensors) on every "
                "worker; the tensors ready in the engine's process (gathering not counted)"
            ),
        }
        address = f"127.0.0.1:{free_port()}"
        host.ask("gathered", address=address, pushes=1 + REPEATS)
        ranks, checks = run_pushes(
            address, path, REPEATS, timeout, lambda ref, v: host.check(ref, None), (GATHERED,)
        )
        gathered = result["load_weights"] = push_figures(ranks[GATHERED])
        gathered["max_abs_logprob_error"] = checks["max_abs_logprob_error"]
        gathered["how"] = (
            "the trainer ranks gather every parameter (full_tensor), rank 0 sends each full "
            "tensor over gloo to vLLM's process, which hands them all to every worker by "
            "collective_rpc into reload_weights and answers; a push ends at the answer"
        )
    result.update(sync_vllm_backend.run(python, path, weight_bytes, max(timeout, 300.0)))
    ours, theirs = result["backend_tandem"], result["backend_vllm_nccl"]
    speedup = round(theirs["seconds"] / ours["seconds"], 3)
    result["backend_target"] = {
        "tandem_backend_vs_best_vllm_backend": speedup,
        "best_vllm_backend": "nccl (over gloo)",
        "target": TARGET,
        "met": speedup >= TARGET,
        "worker_bytes_are_slices": max(ours["bytes_into_each_worker"])
        < min(theirs["bytes_into_each_worker"]),
    }
    best = into["seconds"]
    result["ratios"] = {
        "into_vllm_vs_load_weights": round(gathered["seconds"] / best, 3),
        "into_vllm_vs_load_weights_in_process": round(
            result["load_weights_in_process"]["seconds"] / best, 3
        ),
        "into_vllm_vs_into_tandem": round(result["into_tandem"]["seconds"] / best, 3),
        "tandem_backend_vs_vllm_nccl": speedup,
        "tandem_backend_worker_bytes_vs_vllm_nccl": [
            round(a / b, 4)
            for a, b in zip(
                ours["bytes_into_each_worker"], theirs["bytes_into_each_worker"], strict=True
            )
        ],
    }
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result

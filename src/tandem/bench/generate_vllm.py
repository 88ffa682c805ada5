"""vLLM's CPU build as a side of `tandem bench generate`, run from its own venv.

`VllmPeer` starts `vllm_peer.py` (the driver; it imports only vLLM and the standard library)
with ``.venv-vllm/bin/python`` (``make vllm``), in a session of its own so that closing it ends
vLLM's engine-core and worker processes too. It runs on the bench's model directory, dtype and
thread count: its worker's OpenMP threads are bound to the first ``threads`` cores this process
may use (``VLLM_CPU_OMP_THREADS_BIND``). Its KV cache gets the bench's room, rounded up to whole
vLLM blocks per sequence (``kv_cache_memory_bytes``, the byte form of ``VLLM_CPU_KVCACHE_SPACE``,
which takes GiB), ``max_model_len`` fits the longest sequence, and everything else is vLLM's
default: prefix caching on, chunked prefill, max_num_seqs 256 and max_num_batched_tokens 4096
(its CPU defaults for the offline LLM), its inductor compilation. Each call's figure is the
seconds the driver timed around ``llm.generate``; `round_trip_seconds` adds the JSON transfer.
The driver's stderr (vLLM's log) goes to ``log``; a failure raises with its tail.
"""

from __future__ import annotations

import ctypes.util
import os
import signal
import subprocess
import sys
import time
from math import ceil
from pathlib import Path
from typing import Any

from tandem.bench.generate_peers import Request
from tandem.bench.generate_tandem import GRPO_SEED
from tandem.bench.generate_timing import SelfTimed
from tandem.bench.generate_workloads import Workloads
from tandem.bench.vllm_peer import BLOCK_SIZE, Generate, Generated, Ready, Start, decode, encode

VLLM_VENV = ".venv-vllm"
DRIVER = Path(__file__).with_name("vllm_peer.py")
IDLE_SECONDS = 1.5  # vLLM's worker spins a core for 1 s after its last step (shm_broadcast)
CLOSE_SECONDS = 60  # for vLLM to shut down after stdin closes, before its processes are killed
LOG_TAIL = 3000


def vllm_python() -> Path | None:
    """The vLLM venv's python: ``$TANDEM_VLLM_PYTHON``, else ``.venv-vllm`` in the working
    directory or the source checkout; None when there is none."""
    if override := os.environ.get("TANDEM_VLLM_PYTHON"):
        return Path(override)
    checkout = Path(__file__).resolve().parents[3]
    for root in (Path.cwd(), checkout):
        python = root / VLLM_VENV / "bin" / "python"
        if python.is_file():
            return python
    return None


def preloads(python: Path) -> list[str]:
    """What vLLM's CPU docs ask to LD_PRELOAD, of what is here: tcmalloc (the system's
    libtcmalloc-minimal4, which ``make vllm`` installs where it may) and the venv's Intel
    OpenMP (a dependency of vllm-cpu); its worker warns about each one missing."""
    found = [ctypes.util.find_library("tcmalloc_minimal")]
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    found.append(str(iomp) if iomp.is_file() else None)
    return [lib for lib in found if lib]


def vllm_env(python: Path, bind: str, **extra: str) -> dict[str, str]:
    """The environment of a vLLM process run by ``python``: OpenMP threads bound as ``bind``
    (`VLLM_CPU_OMP_THREADS_BIND`: ``"0,1"`` one engine on two cores, ``"0|1"`` one core per
    worker), `preloads` ahead of any ``LD_PRELOAD`` already set, and ``extra``."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind, **extra)
    preload = ":".join(filter(None, [*preloads(python), os.environ.get("LD_PRELOAD")]))
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def serve_command(python: Path, model_dir: Path, port: int, kv_bytes: int, *options: str) -> list:
    """``vllm serve`` of ``model_dir`` as the benches run it (float32, 256 tokens, ``kv_bytes``
    of KV cache, eager, on 127.0.0.1:``port``) with ``options``. vllm-cpu's ``vllm`` script
    fails looking its own version up: its server module, which ``vllm serve`` runs."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1"),
        *("--dtype", "float32", "--max-model-len", "256"),
        *("--kv-cache-memory-bytes", str(kv_bytes), "--enforce-eager"),
        *options,
    ]


def serve_env(python: Path, bind: str, **extra: str) -> dict[str, str]:
    """`vllm_env` for a `serve_command` process: vLLM's dev-mode routes (``/pause``,
    ``/resume``), its CPU CI settings, its engine in processes of its own."""
    env = vllm_env(python, bind, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_CI_ENV="1", **extra)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def stop_group(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop a vLLM server started in a session of its own (its API server, engine core and
    workers): SIGTERM to the group, SIGKILL past ``grace_s``."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(grace_s)


def kv_cache_bytes(kv_bytes_per_token: int, seqs: list[tuple[int, int]]) -> int:
    """Room for every (prompt, new tokens) sequence at once, each in whole vLLM blocks."""
    blocks = sum(ceil((prompt + new) / BLOCK_SIZE) for prompt, new in seqs)
    return kv_bytes_per_token * BLOCK_SIZE * blocks


class VllmPeer:
    """One running vLLM engine behind the driver; use as a context manager."""

    def __init__(self, python: Path, start: Start, threads: int, log: Path):
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env = vllm_env(python, ",".join(map(str, cores)))
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("w") as err:
            self.process = subprocess.Popen(
                [str(python), str(DRIVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,
            )
        try:
            self.ready: Ready = self._ask(encode(start), Ready)
        except BaseException:
            self._kill()
            raise

    def describe(self) -> dict[str, Any]:
        return {
            "vllm_version": self.ready.vllm_version,
            "torch_version": self.ready.torch_version,
            "load_seconds": self.ready.load_seconds,
            **self.ready.settings,
            "log": str(self.log),
        }

    def greedy(self, reqs: list[Request]) -> SelfTimed:
        """All requests in one ``llm.generate`` call, greedy, EOS ignored."""
        asked = [[k] for _, k in reqs]
        return self._generate(Generate([p for p, _ in reqs], [k for _, k in reqs]), asked)

    def sample(self, prompts: list[list[int]], n: int, new: int) -> SelfTimed:
        """n samples of ``new`` tokens per prompt at temperature 1 (top-p 1, no top-k)."""
        call = Generate(prompts, [new] * len(prompts), n=n, temperature=1.0, top_p=1.0)
        return self._generate(call, [[new] * n for _ in prompts])

    def _generate(self, call: Generate, asked: list[list[int]]) -> SelfTimed:
        start = time.perf_counter()
        done: Generated = self._ask(encode(call), Generated)
        round_trip = time.perf_counter() - start
        time.sleep(IDLE_SECONDS)  # so that its spinning does not slow the side timed next
        if done.token_counts != asked:
            raise RuntimeError(f"vllm produced {done.token_counts} tokens, asked {asked}")
        return SelfTimed(sum(map(sum, asked)), done.seconds, round_trip)

    def _ask(self, line: str, expected: type) -> Any:
        try:
            self.process.stdin.write(line)
            self.process.stdin.flush()
            return decode(self.process.stdout.readline(), expected)
        except (OSError, ValueError) as exc:
            self._kill()
            tail = self.log.read_text(errors="replace")[-LOG_TAIL:]
            raise RuntimeError(
                f"the vLLM peer failed ({exc}); the end of {self.log}:\n{tail}"
            ) from exc

    def close(self) -> None:
        """Close stdin (the driver exits, shutting vLLM down); kill what is left after
        CLOSE_SECONDS."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                print(f"the vLLM peer did not exit in {CLOSE_SECONDS} s; killed", file=sys.stderr)
        self._kill()

    def _kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if not pipe.closed:
                pipe.close()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, kind, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self._kill()


def start_peer(
    python: Path,
    path: Path,
    dtype: str,
    workloads: Workloads,
    kv_bytes_per_token: int,
    threads: int,
) -> VllmPeer:
    """vLLM on the bench model in ``dtype``, room for every workload's sequences at once."""
    scenarios = [
        [
            (prompt, new)
            for prompt, new, samples in workloads.sequences(name)
            for _ in range(samples)
        ]
        for name in ("batch1", "mixed", "grpo")
    ]
    start = Start(
        model=str(path.resolve()),
        dtype=dtype,
        seed=GRPO_SEED,
        max_model_len=max(p + k for seqs in scenarios for p, k in seqs),
        kv_cache_memory_bytes=max(kv_cache_bytes(kv_bytes_per_token, seqs) for seqs in scenarios),
    )
    return VllmPeer(python, start, threads, Path(f".tandem/bench-vllm-{dtype}.log"))

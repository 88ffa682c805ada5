"""`tandem bench serve`: a real `tandem serve` under Poisson load, continuous vs static batching.

Three servers run the same random-init Llama (the generate benchmark's model, float32, CPU) with
the same ``max_num_seqs``: two with continuous (iteration-level) batching, admitting in arrival
order (``continuous``, the default ``fcfs``) or longest output first (``continuous_lof``,
``--scheduling-policy lof``), and one with ``--batching static``, run as a static system would:
length-sorted batches that run until all their requests finish before the next is admitted,
and an idle server lets a burst gather for ``static_batch_window_s`` (50 ms) or until a batch is
full before starting one (without it the first request of a burst ran alone). All are started
once and warmed up; then for each arrival rate the same requests go to one server after the
other (so a noisy moment on the machine hits all alike). Requests are streamed completions with
random token-id prompts (never EOS), ``ignore_eos`` and temperature 0, so each yields exactly
its ``max_tokens``; their prompt and output lengths come from a fixed seed and are the same at
every rate; their ids are new in every run (the same for every mode), so no run reuses prompts
cached by an earlier one. The last step of the sweep is a burst (all requests sent at once), run
``burst_runs`` times per mode, the modes alternating, the best run of each counting: that is
what ``ratios.continuous_vs_fifo`` calls saturation (``ratios.continuous_lof_vs_fifo`` for the
``lof`` server).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tandem.bench.generate import FULL_MODEL, QUICK_MODEL, bench_model_dir
from tandem.bench.serve_load import LoadRequest, poisson_offsets, run_load, summarize
from tandem.server.process import ServerProcess

MODES = {  # name: the server's flags
    "continuous": ["--batching", "continuous"],
    "continuous_lof": ["--batching", "continuous", "--scheduling-policy", "lof"],
    "static": ["--batching", "static"],
}
CONTINUOUS = ("continuous", "continuous_lof")
SERVED_NAME = "tandem-bench"
WORKLOAD_SEED = 0
ARRIVAL_SEED = 1


@dataclass(frozen=True, slots=True)
class Setup:
    model_dir: str
    overrides: dict[str, Any]
    vocab: int
    requests: int
    prompt_tokens: tuple[int, int]  # uniform, inclusive
    max_tokens: tuple[int, int]
    rates_rps: tuple[float, ...]  # Poisson rates swept before the burst, one run each
    burst_runs: int  # per mode; the best counts
    max_num_seqs: int


# a table (ruff would lay each Setup out differently): one a row, its fields in the same order
SETUPS = {
    False: Setup(".tandem/bench-llama-30m", FULL_MODEL, 8192, 64, (8, 256), (16, 128),
                 (1.0, 2.0, 4.0), 3, 16),
    True: Setup(".tandem/bench-llama-quick", QUICK_MODEL, 1024, 16, (8, 64), (4, 32),
                (8.0,), 2, 4),
}  # fmt: skip


def run(quick: bool = False, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Build (or reuse) the model, start the servers, sweep the rates, return the figures."""
    setup = SETUPS[quick]
    path = bench_model_dir(setup)
    config = json.loads((path / "config.json").read_text())
    requests, allowed = _workload(setup, path, config["vocab_size"])
    kv_bytes = _kv_bytes(config, setup)
    options = {
        "--served-model-name": SERVED_NAME,
        "--max-num-seqs": setup.max_num_seqs,
        "--kv-cache-memory": kv_bytes,
        "--max-waiting-requests": 2 * setup.requests,
        "--tp": tp,
        "--pp": pp,
        "--log-level": "warning",
    }
    flags = [str(arg) for option in options.items() for arg in option]
    result: dict[str, Any] = {
        "benchmark": "serve",
        "quick": quick,
        "model": _model_card(path, config),
        "server": {
            "max_num_seqs": setup.max_num_seqs,
            "kv_cache_memory": kv_bytes,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "cpus": os.cpu_count(),
            "modes": MODES,  # each server's own flags
        },
        "workload": {
            "requests": setup.requests,
            "prompt_tokens_range": list(setup.prompt_tokens),
            "max_tokens_range": list(setup.max_tokens),
            "prompt_tokens": sum(len(r.prompt) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
            "seed": WORKLOAD_SEED,
            "arrival_seed": ARRIVAL_SEED,
        },
        "rates_rps": list(setup.rates_rps),
        "saturation": f"burst: all requests sent at once, best of {setup.burst_runs} per mode",
    }
    started = time.perf_counter()
    servers: dict[str, ServerProcess] = {}
    try:
        for mode, mode_flags in MODES.items():
            servers[mode] = ServerProcess(["--model", str(path), *flags, *mode_flags])
        warmup = [LoadRequest(r.prompt, min(r.max_tokens, 4)) for r in requests]
        for mode, server in servers.items():
            if (warm := _load(server, warmup[: setup.max_num_seqs], None))["failed"]:
                raise RuntimeError(f"the {mode} server failed its warm-up: {warm['errors']}")
        result["start_seconds"] = round(time.perf_counter() - started, 2)
        fresh = _Fresh(requests, allowed)
        result["sweep"] = [_step(servers, fresh, rate, 1) for rate in setup.rates_rps]
        result["sweep"].append(_step(servers, fresh, None, setup.burst_runs))
        result["peak_rss_bytes"] = {mode: s.peak_rss_bytes() for mode, s in servers.items()}
    finally:
        exit_codes = {mode: server.stop() for mode, server in servers.items()}
    result["exit_codes"] = exit_codes  # 0: stopped cleanly on SIGTERM
    result["seconds"] = round(time.perf_counter() - started, 2)
    result["ratios"] = {f"{m}_vs_fifo": result["sweep"][-1][f"{m}_vs_fifo"] for m in CONTINUOUS}
    return result


class _Fresh:
    """The workload's requests (lengths, max_tokens) with new prompt ids for every run, so no
    run is served from prompts an earlier run left in a server's prefix cache; every mode gets
    the same ids in a run."""

    def __init__(self, requests: list[LoadRequest], allowed: list[int]):
        self.requests, self.allowed, self.runs = requests, allowed, 0

    def next(self) -> list[LoadRequest]:
        self.runs += 1
        rng = random.Random(f"{WORKLOAD_SEED}-run-{self.runs}")
        return [
            LoadRequest(rng.choices(self.allowed, k=len(r.prompt)), r.max_tokens)
            for r in self.requests
        ]


def _step(
    servers: dict[str, ServerProcess], fresh: _Fresh, rate: float | None, runs: int
) -> dict[str, Any]:
    """``runs`` runs per mode, the modes alternating; the best run (tokens/s) of each counts."""
    entry: dict[str, Any] = {"arrivals": "burst" if rate is None else "poisson", "rate_rps": rate}
    figures: dict[str, list[dict[str, Any]]] = {mode: [] for mode in servers}
    for _ in range(runs):
        requests = fresh.next()
        for mode, server in servers.items():
            figures[mode].append(_load(server, requests, rate))
            print(
                f"bench serve: {_label(rate)} {mode}: {figures[mode][-1]['tokens_per_s']} tok/s",
                file=sys.stderr,
                flush=True,
            )
    for mode, found in figures.items():
        entry[mode] = max(found, key=lambda m: m["tokens_per_s"])
        entry[mode]["tokens_per_s_runs"] = [m["tokens_per_s"] for m in found]
    static = entry["static"]["tokens_per_s"]
    for mode in CONTINUOUS:  # None: every static request failed
        entry[f"{mode}_vs_fifo"] = (
            round(entry[mode]["tokens_per_s"] / static, 3) if static else None
        )
    return entry


def _load(server: ServerProcess, requests: list[LoadRequest], rate: float | None) -> dict:
    offsets = poisson_offsets(len(requests), rate, ARRIVAL_SEED)
    results, seconds = asyncio.run(run_load(server.url, SERVED_NAME, requests, offsets))
    return summarize(results, seconds)


def _workload(setup: Setup, path: Path, vocab: int) -> tuple[list[LoadRequest], list[int]]:
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    allowed = [t for t in range(vocab) if t not in eos_ids]
    rng = random.Random(WORKLOAD_SEED)
    out = []
    for _ in range(setup.requests):
        prompt = rng.choices(allowed, k=rng.randint(*setup.prompt_tokens))
        out.append(LoadRequest(prompt, rng.randint(*setup.max_tokens)))
    return out, allowed


def _kv_bytes(config: dict[str, Any], setup: Setup) -> int:
    """Room for max_num_seqs of the longest requests (no preemption in either mode)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    tokens = setup.max_num_seqs * (setup.prompt_tokens[1] + setup.max_tokens[1] + 32)
    return per_token * tokens


def _model_card(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    params = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            params += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return {
        "params": params,
        "hidden": config["hidden_size"],
        "layers": config["num_hidden_layers"],
        "heads": config["num_attention_heads"],
        "kv_heads": config["num_key_value_heads"],
        "vocab": config["vocab_size"],
        "dtype": "float32",
    }


def _label(rate: float | None) -> str:
    return "burst" if rate is None else f"{rate:g} req/s"


def summary(result: dict[str, Any]) -> str:
    """One line per rate and mode, then the ratio."""
    lines = [
        f"{'arrivals':>10} {'mode':>14} {'tok/s':>8} {'req/s':>6} {'ttft p50/p99 s':>15} "
        f"{'latency p50/p99 s':>18} {'ok/failed':>9}"
    ]
    for entry in result["sweep"]:
        for mode in MODES:
            m = entry[mode]
            lines.append(
                f"{_label(entry['rate_rps']):>10} {mode:>14} {m['tokens_per_s']:>8.1f} "
                f"{m['requests_per_s']:>6.2f} {_pair(m, 'ttft'):>15} "
                f"{_pair(m, 'latency'):>18} {m['completed']:>5}/{m['failed']}"
            )
    for name, ratio in result["ratios"].items():
        lines.append(f"{name} (burst): {'-' if ratio is None else f'{ratio:.2f}x'}")
    return "\n".join(lines)


def _pair(m: dict[str, Any], key: str) -> str:
    lo, hi = m[f"{key}_p50_s"], m[f"{key}_p99_s"]
    return "-" if lo is None else f"{lo:.2f}/{hi:.2f}"

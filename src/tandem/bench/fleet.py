"""`tandem bench fleet`: one push into a fleet of replicas against the naive fleet push, and
routing over replicas against one engine. Measured in one run, on this host:

- ``push``: the sync bench's model (`tandem.bench.sync.bench_model`) served by
  ``LLM(data_parallel_size=R, tensor_parallel_size=T)`` in this process, for each (R, T) of
  `FLEETS`; the same 2 FSDP2 trainer processes as `tandem bench sync`
  (`tandem.bench.sync_pushes`) push into ``llm.exchange_address`` with ``transport="shm"`` and
  ``"dist"`` (staged): one untimed push, then ``REPEATS`` timed, each carrying weights the
  trainers have just scaled, and after each, untimed, every replica's greedy output is checked
  against a reference of the trainer's weights. ``trainer_egress_over_needed`` is the bytes
  the trainers' transports counted over one copy of what a replica holds; ``ingress_over_needed``
  per replica is what arrived at its ranks (counted there) over what it holds.
- ``naive``: what RL stacks do for a fleet, in memory: the 2 FSDP2 trainer ranks and R x T engine
  ranks (the tensor-parallel model built, not started) in one gloo group; per push trainer rank 0
  gathers each parameter (``full_tensor()``) and sends the full tensor to every engine rank,
  tensor by tensor (``broadcast``: one gloo broadcast over all of them; ``isend``: to each
  engine rank, replica after replica; the faster counts), and each engine rank copies its
  tensor-parallel part into its parameters (`tandem.bench.sync_worker.naive`). The same best of
  ``REPEATS`` after a warm-up; a push is the barrier to the slowest engine rank's last copy.
- ``link_model``: the schedule simulation `tandem plan` runs at scale (`tandem.scale.local`)
  predicts each push above from link speeds measured in this run (copy and CRC32 rates on one
  core and on all at once, a raw gloo run of two streams at once, every core busy): each push
  gets ``predicted_seconds`` and ``predicted_over_measured``.
- ``routing``: the generate bench's model and its ``grpo`` (n samples of each prompt) and
  ``mixed`` workloads through ``LLM(data_parallel_size=1)`` and ``LLM(data_parallel_size=2)``
  at the same total threads (one engine: this process's threads; two replicas: their workers
  split the cores), alternating, best of ``REPEATS`` runs on fresh prompts: tokens per second,
  the prefix-cache hit rate over the timed runs, requests per replica.

``--quick`` uses the small models, so the run takes about a minute.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from tandem.bench import sync_baselines as base
from tandem.bench.generate import SETUPS as GENERATE_SETUPS
from tandem.bench.generate import bench_model_dir
from tandem.bench.generate_tandem import sample, tandem
from tandem.bench.generate_timing import time_sides
from tandem.bench.generate_workloads import (
    fresh_runs,
    greedy_workloads,
    grpo_workload,
    read_bench_model,
)
from tandem.bench.phases import Phases
from tandem.bench.sync import bench_model, push_figures, weights_of
from tandem.bench.sync_baselines import REPEATS
from tandem.bench.sync_pushes import NEW_TOKENS, PROMPT, Reference, run_pushes, scored
from tandem.engine.stats import combined

FLEETS = ((1, 1), (2, 1), (3, 1), (2, 2))  # (replicas, tensor parallel size per replica)
KV_CACHE_MEMORY = 64 << 20
PUSH_MODES = ("shm", "dist")


def run(quick: bool = False) -> dict[str, Any]:
    from tandem import LLM

    phases = Phases()
    lap = phases.lap

    path = bench_model(quick)
    params, weight_bytes = weights_of(path)
    timeout = 180.0 if quick else 900.0
    result: dict[str, Any] = {
        "benchmark": "fleet",
        "quick": quick,
        "threads": torch.get_num_threads(),
        "repeats": REPEATS,
        "push": {
            "model": {
                "params": params,
                "bytes": weight_bytes,
                "dtype": "float32",
                "dir": str(path),
            },
            "trainer": {"ranks": 2, "sharding": "FSDP2", "backend": "gloo"},
            "fleets": {},
        },
    }
    checks = []
    for replicas, tp in FLEETS:
        key = f"dp{replicas}_tp{tp}"
        with LLM(
            str(path),
            data_parallel_size=replicas,
            tensor_parallel_size=tp,
            kv_cache_memory=KV_CACHE_MEMORY,
            dtype="float32",
        ) as llm:
            ranks, check = run_pushes(
                llm.exchange_address,
                path,
                REPEATS,
                timeout,
                lambda ref, v, llm=llm: check_replicas(llm, ref, v),
                PUSH_MODES,
            )
        checks.append(check)
        entry = {mode: fleet_figures(per_rank, replicas) for mode, per_rank in ranks.items()}
        lap(f"push_{key}")
        sends = ("broadcast",) if quick else ("broadcast", "isend")
        naive = {send: base.naive(path, timeout, send, replicas, tp) for send in sends}
        best = min(naive, key=lambda s: naive[s]["seconds"])
        entry["naive"] = {
            **naive[best],
            "send": best,
            "seconds_by_send": {s: n["seconds"] for s, n in naive.items()},
            "trainer_egress_over_needed": replicas * tp if best == "isend" else None,
        }
        lap(f"naive_{key}")
        result["push"]["fleets"][key] = {"replicas": replicas, "tensor_parallel_size": tp, **entry}
    result["push"]["link_model"] = predict_fleet_pushes(result["push"]["fleets"], timeout)
    lap("link_model")
    result["push"]["checks"] = {
        "pushes_checked": sum(c["pushes_checked"] for c in checks),
        "replicas_checked_per_push": "every replica",
        "max_abs_logprob_error": max(c["max_abs_logprob_error"] for c in checks),
        "tolerance": checks[0]["tolerance"],
    }
    result["routing"] = routing(quick)
    lap("routing")
    result["phase_seconds"] = phases.seconds
    fleets = result["push"]["fleets"]
    r3 = fleets["dp3_tp1"]
    grpo = result["routing"]["grpo"]
    result["ratios"] = {
        "fleet_vs_naive": round(r3["naive"]["seconds"] / r3["shm"]["seconds"], 3),
        "fleet_gloo_vs_naive": round(r3["naive"]["seconds"] / r3["dist"]["seconds"], 3),
        "dp2_vs_dp1": round(grpo["dp2_tokens_per_s"] / grpo["dp1_tokens_per_s"], 3),
        "dp2_vs_dp1_mixed": round(
            result["routing"]["mixed"]["dp2_tokens_per_s"]
            / result["routing"]["mixed"]["dp1_tokens_per_s"],
            3,
        ),
    }
    result["targets"] = {
        "trainer_egress_over_needed": max(
            f[m]["trainer_egress_over_needed"] for f in fleets.values() for m in PUSH_MODES
        ),
        "ingress_over_needed_max": max(
            max(f[m]["ingress_over_needed"]) for f in fleets.values() for m in PUSH_MODES
        ),
        "ingress_over_needed_min": min(
            min(f[m]["ingress_over_needed"]) for f in fleets.values() for m in PUSH_MODES
        ),
        "hit_rate_dp2_minus_dp1": round(
            grpo["dp2_engine"]["prefix_cache_hit_rate"]
            - grpo["dp1_engine"]["prefix_cache_hit_rate"],
            4,
        ),
    }
    result["notes"] = [
        "fleet_vs_naive: the naive fleet push over tandem's default push on one host (shm "
        "staged: every replica reads the trainers' one staging), 3 replicas of TP 1, as "
        "`tandem bench sync`'s vs_naive; fleet_gloo_vs_naive: over tandem's dist push (both "
        "gloo; replicas relay to each other in a chain).",
        "dp2_vs_dp1: grpo tokens/s of two replicas over one engine at the same total threads.",
    ]
    return result


def predict_fleet_pushes(fleets: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The link model (`tandem.scale.local`) of every fleet push above, from this run's core
    rates and the node's loopback rate (a raw gloo run of two streams at once, each half of a
    replica's bytes, from 2 sender to 2 receiver processes: every core busy, as the sync
    bench's raw run): adds ``predicted_seconds``, ``predicted_over_measured`` and
    ``predicted_phases`` to each push. (A raw run shaped like the one-replica push, 2 senders
    into one receiver, is walked a stream at a time and measured 0.13-0.31 s for the same
    bytes from run to run: no rate to predict by.)"""
    from tandem.scale.local import LocalRates, predict_push, stream_rate

    one = fleets["dp1_tp1"]
    half = one["shm"]["bytes_needed"] // 2
    cpu = base.cpu_rates(half)
    streams = [[half, 0], [0, half]]
    raw = base.raw_gloo(streams, timeout)
    gloo = stream_rate(streams, raw["seconds"])
    for fleet in fleets.values():
        replicas, tp = fleet["replicas"], fleet["tensor_parallel_size"]
        for mode in PUSH_MODES:
            push = fleet[mode]
            per_rank = push["bytes_by_receiver_per_rank"]
            if any(any(row[tp:]) for row in per_rank):  # trainers feed the first replica only
                raise RuntimeError(f"{mode} push sent trainers' bytes past replica 0: {per_rank}")
            rates = LocalRates.measured(cpu, gloo if mode == "dist" else None)
            predicted = predict_push(
                mode,
                [row[:tp] for row in per_rank],
                rates,
                replicas=replicas,
                engine_threads=engine_threads(replicas * tp),
            )
            push["predicted_seconds"] = round(predicted["seconds"], 6)
            push["predicted_over_measured"] = round(predicted["seconds"] / push["seconds"], 3)
            push["predicted_phases"] = {k: round(v, 6) for k, v in predicted["phases"].items()}
    return {
        **cpu,
        "raw_gloo": raw,
        "stream_Bps": round(gloo),
        "note": "tandem.scale.local on this host's measured copy/CRC rates and a raw gloo "
        "run of two streams at once (the relay chain simulated); nothing fitted",
    }


def engine_threads(ranks: int) -> int:
    """Torch threads of each engine rank: the engine's own rule (one rank runs in this
    process; workers split the cores, `tandem.engine.worker`)."""
    return torch.get_num_threads() if ranks == 1 else max(1, (os.cpu_count() or 1) // ranks)


def check_replicas(llm, reference: Reference, version: int) -> float:
    """`scored` on every replica: the bench prompt, greedy, generated on each in turn."""
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    errors = []
    for engine in _engines(llm):
        seqs = engine.admission.make_sequences(f"bench-check-{version}", PROMPT, params, 0)
        engine.add(seqs)
        engine.run(seqs)
        out = seqs[0].output("")
        served = max(seqs[0].weight_versions) if seqs[0].weight_versions else None
        errors.append(scored(reference, out.token_ids, out.logprobs, served, version))
    return max(errors)


def fleet_figures(per_rank: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    """`push_figures` plus what each replica took in, from the pushes' counted stats."""
    figures = push_figures(per_rank)
    shares = per_rank[0]["replicas"]
    if len(shares) != replicas:
        raise RuntimeError(f"{len(shares)} replicas reported, {replicas} expected")
    figures["trainer_egress_over_needed"] = round(
        figures["bytes_moved"] / figures["bytes_needed"], 4
    )
    figures["ingress_over_needed"] = [round(r["bytes_in"] / r["bytes_needed"], 4) for r in shares]
    figures["bytes_relayed"] = [r["bytes_relayed"] for r in shares]
    figures["replica_seconds"] = [round(r["seconds"], 4) for r in shares]
    return figures


def routing(quick: bool) -> dict[str, Any]:
    """grpo and mixed through one engine and through two replicas (see the module doc)."""
    from tandem import LLM

    setup = GENERATE_SETUPS[quick]
    path = bench_model_dir(setup)
    config, eos_ids = read_bench_model(path)
    vocab = config["vocab_size"]
    rng = random.Random(0)
    _, mixed = greedy_workloads(rng, vocab, eos_ids, setup.batch1, setup.mixed)
    _, n, _, _, new = setup.grpo
    grpo = grpo_workload(rng, vocab, eos_ids, setup.grpo)
    runs = fresh_runs(rng, vocab, eos_ids, mixed=mixed, grpo=grpo)
    options = dict(dtype="float32", kv_cache_memory=256 << 20)
    out: dict[str, Any] = {"model": str(path), "samples_per_prompt": n, "new_tokens": new}
    with LLM(str(path), **options) as dp1, LLM(str(path), data_parallel_size=2, **options) as dp2:
        llms = {"dp1": dp1, "dp2": dp2}
        for llm in llms.values():  # warm-up
            sample(llm, [p for p, _ in grpo[:2]], n, 8)
        for name, reqs, fn in (
            ("grpo", runs["grpo"], lambda llm, r: sample(llm, [p for p, _ in r], n, new)),
            ("mixed", runs["mixed"], tandem),
        ):
            entry = {"tokens": sum(k for _, k in reqs[0]), "requests": len(reqs[0])}
            before = {k: (_stats(llm), _requests(llm)) for k, llm in llms.items()}
            sides = {k: (lambda r, llm=llm, fn=fn: fn(llm, r)) for k, llm in llms.items()}
            time_sides(entry, sides, reqs)
            for k, llm in llms.items():
                stats, requests = before[k]
                after = _stats(llm)
                queried = after.prefix_cache_queried_tokens - stats.prefix_cache_queried_tokens
                hits = after.prefix_cache_hit_tokens - stats.prefix_cache_hit_tokens
                entry[f"{k}_engine"] = {
                    "prefix_cache_hit_rate": round(hits / queried, 4) if queried else 0.0,
                }
                if requests is not None:
                    entry[f"{k}_engine"]["requests_per_replica"] = [
                        a - b for a, b in zip(_requests(llm), requests, strict=True)
                    ]
            out[name] = entry
    out["threads"] = {"dp1": torch.get_num_threads(), "dp2": "each replica's worker: cores // 2"}
    return out


def _engines(llm) -> list:
    """The replicas' engines (one replica: the LLM's engine)."""
    return [llm.engine] if llm.fleet is None else llm.fleet.engines


def _stats(llm):
    return combined([engine.stats() for engine in _engines(llm)])


def _requests(llm) -> list[int] | None:
    """Requests routed to each replica so far (a fleet's router counts them; one engine is
    not routed: None)."""
    return None if llm.fleet is None else list(llm.fleet.policy.requests)


def summary(result: dict[str, Any]) -> str:
    lines = [f"{k}: {v:.2f}x" for k, v in result["ratios"].items()]
    for key, f in result["push"]["fleets"].items():
        lines.append(
            f"{key}: shm {f['shm']['seconds']:.3f} s, dist {f['dist']['seconds']:.3f} s,"
            f" naive {f['naive']['seconds']:.3f} s ({f['naive']['send']}); egress "
            f"{f['dist']['trainer_egress_over_needed']}x, ingress "
            f"{f['dist']['ingress_over_needed']}"
        )
    lines.append(f"targets: {result['targets']}")
    return "\n".join(lines)

"""`tandem bench sync`: how fast a trainer's weights land in a live engine, against baselines.

Measured in one run, on this host, on the same bytes:

- ``shm``: 2 FSDP2 trainer processes (gloo, ``torch.distributed`` on CPU) each call
  ``WeightSender(model, llm.exchange_address).push(version)`` into an
  ``LLM(tensor_parallel_size=2)`` in this process: one untimed push (plans, caches, maps), then
  ``REPEATS`` timed ones (`tandem.bench.sync_pushes`). Every push carries changed weights (the
  trainers scale theirs before each, untimed) and after each, untimed, the engine's greedy
  output is checked against a reference of the trainer's weights (``checks``). A push's time
  is its wall time on the slowest trainer rank (staging, CRC32s, the engine's verify and commit
  on both of its ranks); the best push counts. ``bytes_moved`` is what the transports counted
  as they wrote or sent. ``shm``
  is the default ``staged`` mode, ``shm_in_place`` is ``mode="in_place"`` (the trainer ranks
  write straight into the engine's shared parameters); ``unverified_seconds``: the same pushes
  with ``verify=False`` (no CRC32 on either side).
- ``gloo`` / ``gloo_in_place``: the same trainer processes push with ``transport="dist"``
  (trainer and engine ranks in one gloo group, point to point), ``staged`` / ``in_place``;
  ``gloo_in_place.unverified_seconds``: ``in_place`` with ``verify=False``.
- ``memcpy``: a copy of two preallocated uint8 tensors of ``bytes_needed`` bytes in this
  process, the faster of torch's ``dst.copy_(src)`` and a copy storing past the cache on a
  thread per core (`tandem.kernels.copy`, what the pushes' copies use), best of ``REPEATS``
  each, at two sittings (after the pushes, and again after the other baselines; the faster
  counts; the raw transports' floors likewise, but for ``--quick``): the floor for moving
  those bytes once through memory.
- ``raw_gloo``: the dist push's traffic without tandem: 2 sender and 2 receiver processes in one
  gloo group (TCP on loopback), 4 streams of exactly the bytes the dist push's transports
  counted per (trainer rank, engine rank) stream, of preallocated uint8 tensors, walked in the
  push's rounds (2 streams at a time);
  best of ``REPEATS`` after a warm-up, a run timed to the slowest receiver's last message, at
  two sittings as ``memcpy``: the floor for a torch.distributed transport on CPU moving those
  bytes that way.
- ``mooncake`` / ``mooncake_in_place``: the same trainer processes push with
  ``transport="mooncake"`` (the engine's ranks read each box with one-sided batched reads, TCP
  on loopback, out of the trainer's registered tensor where it is contiguous, else out of its
  registered staging; staged into a landing buffer then committed, or in place into the
  registered live parameters; verified); ``raw_mooncake``: Mooncake's own reads of exactly
  the bytes that push's transports counted per (trainer rank, engine rank), between 2 sender
  and 2 receiver processes with memory registered once, one batched read per stream (two
  sittings, as ``memcpy``)
  (`mooncake_vs_raw`: in place, as `shm_vs_memcpy`; `mooncake_staged_vs_raw`).
- ``link_model``: what the same schedule simulation `tandem plan` runs at cluster scale
  predicts for each push above (`tandem.scale.local`), from link speeds measured in this run:
  a copy and a CRC32 on one thread and on every core at once (``cpu_rates``), and the raw
  gloo / Mooncake streams; each push gets ``predicted_seconds`` and
  ``predicted_over_measured`` (and ``unverified_*`` where measured).
- ``naive``: what RL stacks do in memory: 2 FSDP2 trainer ranks and the 2 ranks of a
  tensor-parallel tandem model (built, not started: no engine, no KV cache) in one gloo group.
  Per push, trainer rank 0 gathers each parameter (``p.full_tensor()``, rank 1 joins) and sends
  the full tensor to both engine ranks, tensor by tensor; each receives it into a preallocated
  buffer and copies its shard into its parameters through ``param.pieces`` (load_weights-style,
  TP split included). Best of ``REPEATS`` after a warm-up, a push timed to the slowest engine
  rank's last copy; ``gather_seconds``: rank 0's gathering part.
- ``planner``: `tandem.exchange.plan.plan_transfers` on metadata-only layouts (no tensors) of a
  1T-parameter MoE, 1024 trainer ranks -> 512 engine ranks (see `tandem.bench.moe_layout`),
  timed once in a subprocess (one core: the planner is pure Python). ``bound_max_over_mean``:
  the best sender balance any plan can reach for the layouts (a stage's load stays on its own
  ranks; what only one sender holds, it sends); ``max_over_bound``: the plan's
  ``sender_max_over_mean`` over it.

``--quick`` uses a model of a few MiB and a small MoE layout, so the run takes seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from tandem.bench import sync_baselines as base
from tandem.bench.phases import Phases
from tandem.bench.sync_baselines import REPEATS
from tandem.bench.sync_pushes import check, run_pushes
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
KV_CACHE_MEMORY = 64 << 20


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

    phases = Phases()
    lap = phases.lap

    path = bench_model(quick)
    config = json.loads((path / "config.json").read_text())
    params, weight_bytes = weights_of(path)
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
    # float32 named: dtype="auto" would pick bfloat16 on CPUs with bf16 units, and the checks
    # compare with the float32 trainer at float32 tolerance
    with LLM(
        str(path), tensor_parallel_size=2, kv_cache_memory=KV_CACHE_MEMORY, dtype="float32"
    ) as llm:
        lap("engine_start")
        ranks, result["checks"] = run_pushes(
            llm.exchange_address, path, REPEATS, timeout, lambda ref, v: check(llm, ref, v)
        )
        if llm.weight_version != max(r[0]["version"] for r in ranks.values()):
            raise RuntimeError(f"engine at version {llm.weight_version} after the pushes")
    pushes = {mode: push_figures(per_rank) for mode, per_rank in ranks.items()}
    lap("pushes")
    shm, shm_direct = pushes["shm"], pushes["shm-in_place"]
    shm["mode"], shm_direct["mode"] = "staged", "in_place"
    shm["unverified_seconds"] = pushes["shm-unverified"]["seconds"]  # verify=False: no CRC32s
    shm_direct["unverified_seconds"] = pushes["shm-in_place-unverified"]["seconds"]
    gloo, gloo_direct = pushes["dist"], pushes["dist-in_place"]
    gloo["mode"], gloo_direct["mode"] = "staged", "in_place"
    gloo_direct["unverified_seconds"] = pushes["dist-in_place-unverified"]["seconds"]
    needed = shm["bytes_needed"]
    if any(p["bytes_needed"] != needed for p in pushes.values()):
        raise RuntimeError(f"push modes disagree on bytes_needed: {pushes}")
    result["shm"] = shm
    result["shm_in_place"] = shm_direct
    result["gloo"] = gloo
    result["gloo_in_place"] = gloo_direct
    result["memcpy"] = base.memcpy(needed)
    lap("memcpy")
    streams = pushes["dist-in_place"]["bytes_by_receiver_per_rank"]
    if streams != pushes["dist"]["bytes_by_receiver_per_rank"] or sum(map(sum, streams)) != needed:
        raise RuntimeError(f"dist pushes disagree on their streams: {streams}")
    result["raw_gloo"] = base.raw_gloo(streams, timeout)
    lap("raw_gloo")
    mooncake, mooncake_direct = pushes["mooncake"], pushes["mooncake-in_place"]
    mooncake["mode"], mooncake_direct["mode"] = "staged", "in_place"
    result["mooncake"] = mooncake
    result["mooncake_in_place"] = mooncake_direct
    result["raw_mooncake"] = base.raw_mooncake(mooncake["bytes_by_receiver_per_rank"], timeout)
    lap("raw_mooncake")
    result["naive"] = base.naive(path, timeout)
    lap("naive")
    # the floors once more, a minute on: a floor measured in a slow moment of a shared host
    # would flatter every ratio against it (--quick, whose figures are a shape check: memcpy
    # only, the raw transports' second sitting would be a third of its time)
    result["memcpy"] = base.best_sitting(result["memcpy"], base.memcpy(needed))
    raw_again = {
        "raw_gloo": lambda: base.raw_gloo(streams, timeout),
        "raw_mooncake": lambda: base.raw_mooncake(mooncake["bytes_by_receiver_per_rank"], timeout),
    }
    for name, measure in raw_again.items():
        again = [] if quick else [measure()]
        result[name] = base.best_sitting(result[name], *again)
    lap("floors_again")
    result["link_model"] = predict_pushes(result, needed)
    lap("link_model")
    result["bytes_moved_over_needed"] = max(p["bytes_moved"] for p in pushes.values()) / needed
    result["planner"] = base.planner(quick, timeout=120.0 if quick else PLANNER_TIMEOUT_S)
    lap("planner")
    result["phase_seconds"] = phases.seconds  # each part's wall time, processes included
    planner_s = result["planner"]["seconds"]
    memcpy, raw = result["memcpy"]["seconds"], result["raw_gloo"]["seconds"]
    result["ratios"] = {
        "shm_vs_memcpy": round(memcpy / shm_direct["seconds"], 3),
        "gloo_vs_raw_gloo": round(raw / gloo_direct["seconds"], 3),
        "vs_naive": round(result["naive"]["seconds"] / shm["seconds"], 3),
        "vs_naive_gloo": round(result["naive"]["seconds"] / gloo["seconds"], 3),
        "shm_staged_vs_memcpy": round(memcpy / shm["seconds"], 3),
        "gloo_staged_vs_raw_gloo": round(raw / gloo["seconds"], 3),
        "shm_unverified_vs_memcpy": round(memcpy / shm_direct["unverified_seconds"], 3),
        "shm_vs_torch_copy": round(
            result["memcpy"]["torch_copy_seconds"] / shm_direct["seconds"], 3
        ),
        "gloo_unverified_vs_raw_gloo": round(raw / gloo_direct["unverified_seconds"], 3),
        "mooncake_vs_raw": round(result["raw_mooncake"]["seconds"] / mooncake_direct["seconds"], 3),
        "mooncake_staged_vs_raw": round(result["raw_mooncake"]["seconds"] / mooncake["seconds"], 3),
    }
    result["notes"] = [
        "shm_vs_memcpy and gloo_vs_raw_gloo time mode='in_place' (the one-copy paths: trainer "
        "ranks write into the engine's shared parameters / the engine receives into them), with "
        "CRC32 verification on; *_staged_* time the default mode='staged'; vs_naive uses shm "
        "staged, vs_naive_gloo dist staged (naive's backend). *_unverified_*: in_place with "
        "verify=False (memcpy and raw gloo checksum nothing either). memcpy is the faster of "
        "torch's copy_ and a copy storing past the cache; shm_vs_torch_copy: the same push "
        "against torch's copy_ alone.",
        f"raw_gloo: {base.RAW_GLOO_NOTE}.",
        f"naive: {base.NAIVE_NOTE}.",
    ]
    if planner_s is None:
        result["notes"].append(
            f"the planner did not finish within {result['planner']['timeout_s']} s; "
            "planner.seconds is null"
        )
    return result


PLANNER_TIMEOUT_S = 450.0

# bench key -> (the link model's push kind, the raw baseline its streams are calibrated on)
PREDICTED = {
    "shm": ("shm", None),
    "shm_in_place": ("shm_in_place", None),
    "gloo": ("dist", "raw_gloo"),
    "gloo_in_place": ("dist_in_place", "raw_gloo"),
    "mooncake": ("mooncake", "raw_mooncake"),
    "mooncake_in_place": ("mooncake_in_place", "raw_mooncake"),
}


def predict_pushes(result: dict[str, Any], needed: int) -> dict[str, Any]:
    """The link model (`tandem.scale.local`) of each push measured above, from this run's
    core rates and raw streams: adds ``predicted_seconds`` and ``predicted_over_measured`` to
    each push's figures (``unverified_*`` too where measured); returns the rates it used."""
    from tandem.scale.local import LocalRates, predict_push, stream_rate

    cpu = base.cpu_rates(needed // 2)  # what one trainer rank or one engine rank handles
    streams = {
        raw: stream_rate(result[raw]["streams"], result[raw]["seconds"])
        for raw in ("raw_gloo", "raw_mooncake")
    }
    for key, (kind, raw) in PREDICTED.items():
        push = result[key]
        rates = LocalRates.measured(cpu, streams.get(raw))
        per_stream = push["bytes_by_receiver_per_rank"]
        for verify, field in ((True, ""), (False, "unverified_")):
            if f"{field}seconds" not in push:
                continue
            threads = max(1, cpu["cores"] // 2)  # each of the engine's TP=2 workers
            predicted = predict_push(
                kind,
                per_stream,
                rates,
                verify=verify,
                engine_threads=threads,
                staged=push["bytes_staged_per_rank"],
            )
            push[f"{field}predicted_seconds"] = round(predicted["seconds"], 6)
            push[f"{field}predicted_over_measured"] = round(
                predicted["seconds"] / push[f"{field}seconds"], 3
            )
            if verify:
                push["predicted_phases"] = {k: round(v, 6) for k, v in predicted["phases"].items()}
    return {
        **cpu,
        "stream_Bps": {k: round(v) for k, v in streams.items()},
        "note": "tandem.scale.local: the schedule simulation of each push's phases on "
        "this host's measured copy/CRC rates and raw stream speeds; nothing fitted",
    }


def bench_model(quick: bool) -> Path:
    """The model directory of `SETUPS` (made on first use, then reused)."""
    model_dir, overrides, vocab = SETUPS[quick]
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama", seed=0, vocab_size=vocab, overrides=overrides)
    return path


def weights_of(path: Path) -> tuple[int, int]:
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


def push_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_push = [max(r["seconds"][i] for r in ranks) for i in range(REPEATS)]  # slowest rank
    best = min(per_push)
    first = ranks[0]
    if any(
        (r["bytes_needed"], r["bytes_moved"]) != (first["bytes_needed"], first["bytes_moved"])
        for r in ranks
    ):
        raise RuntimeError(f"trainer ranks disagree on the bytes: {ranks}")
    return {
        "seconds": round(best, 6),
        "gib_per_s": base.gib_per_s(first["bytes_needed"], best),
        "bytes_needed": first["bytes_needed"],
        "bytes_moved": first["bytes_moved"],
        "bytes_sent_per_rank": [r["bytes_sent"] for r in ranks],
        "bytes_by_receiver_per_rank": [r["bytes_by_receiver"] for r in ranks],
        "bytes_staged_per_rank": [r.get("bytes_staged") for r in ranks],
        "seconds_per_push": [round(s, 6) for s in per_push],
        "warmup_seconds": round(max(r["warmup_seconds"] for r in ranks), 4),
        "transport": first["transport"],
        "timing": f"best of {REPEATS} pushes after a warm-up; a push is its slowest rank's time",
    }


def summary(result: dict[str, Any]) -> str:
    """The ratios (null ones marked n/a) and the headline figures, one per line."""
    lines = [f"{k}: {'n/a' if v is None else f'{v:.2f}x'}" for k, v in result["ratios"].items()]
    shm, planner = result["shm"], result["planner"]
    lines.append(f"shm push: {shm['seconds']:.3f} s, {shm['gib_per_s']:.2f} GiB/s")
    lines.append(f"bytes_moved_over_needed: {result['bytes_moved_over_needed']:.3f}")
    seconds = "did not finish" if planner["seconds"] is None else f"{planner['seconds']:.1f} s"
    lines.append(
        f"planner ({planner['trainer_ranks']} -> {planner['engine_ranks']} ranks): {seconds}"
    )
    return "\n".join(lines)

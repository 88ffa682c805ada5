"""`tandem bench sync --into serve`: pushes into a TP=2 `tandem serve` from a trainer process
(this one), vLLM's RL weight-transfer protocol against tandem's own push, same server, same
run.

- ``broadcast`` / ``broadcast_in_place``: `BroadcastClient` (the protocol's trainer side, as
  vLLM's client runs it: one rank broadcasting every full tensor, 64 MiB per call) — every
  engine rank receives every byte and keeps its slices; staged, or into the live weights;
- ``shm`` / ``dist``: `WeightSender(model, url, admin_key)` over the server's exchange
  (found through ``GET /admin/weights``): each engine rank receives only its own slices.

Per kind one untimed push, then ``REPEATS`` timed ones; the trainer alternates between two
checkpoints of the same shape, so every push moves weights the engine does not hold, and after
each kind the server's greedy tokens are checked against a tandem engine loaded from the
checkpoint last pushed (untimed). Reported: seconds (best, median), bytes the trainer sent and
bytes the engine's ranks received; ratios against ``shm``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.bench.sync import FULL_MODEL, QUICK_MODEL, weights_of
from tandem.bench.sync_baselines import REPEATS

KINDS = ("broadcast", "broadcast_in_place", "shm", "dist")
PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
KEY = "tandem-bench-admin-key-0123456789"
TP = 2


def _checkpoints(quick: bool) -> list[Path]:
    from tandem.models.tiny import make_tiny_model

    overrides, vocab = (QUICK_MODEL, 2048) if quick else (FULL_MODEL, 32000)
    out = []
    for seed in (1, 2):
        path = Path(f".tandem/bench-sync-serve{'-quick' if quick else ''}-{seed}")
        if not (path / "config.json").is_file():
            make_tiny_model(path, "llama", seed=seed, vocab_size=vocab, overrides=overrides)
        out.append(path)
    return out


def _greedy(url: str, model: str) -> list[int]:
    import json
    import urllib.request

    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def run(quick: bool = False) -> dict[str, Any]:
    import transformers

    from tandem import LLM, SamplingParams
    from tandem.exchange import WeightSender
    from tandem.exchange.broadcast_client import BroadcastClient
    from tandem.server.process import ServerProcess

    dirs = _checkpoints(quick)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = []
    for d in dirs:
        with LLM(str(d), dtype="float32", kv_cache_memory=32 << 20) as ref:
            expected.append(ref.generate([PROMPT], params)[0].outputs[0].token_ids)
    models = [
        transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in dirs
    ]
    _, nbytes = weights_of(dirs[0])
    server = ServerProcess(
        [
            "--model",
            str(dirs[0]),
            "--tp",
            str(TP),
            "--dtype",
            "float32",
            "--admin-key",
            KEY,
            "--kv-cache-memory",
            str(32 << 20),
        ]
    )
    kinds: dict[str, Any] = {}
    try:
        for kind in KINDS:
            if kind.startswith("broadcast"):
                mode = "in_place" if kind.endswith("in_place") else "staged"
                client = BroadcastClient(server.url, KEY, mode=mode)

                def push(model, client=client) -> int:
                    before = client.bytes_sent
                    client.push(model.named_parameters())
                    return TP * (client.bytes_sent - before)  # every rank gets every byte

                close = client.close
            else:
                senders = [
                    WeightSender(m, server.url, admin_key=KEY, transport=kind) for m in models
                ]

                def push(model, senders=senders) -> int:
                    stats = senders[models.index(model)].push()
                    return stats.bytes_moved

                def close(senders=senders) -> None:
                    for s in senders:
                        s.close()

            seconds, received, last = [], 0, 0
            try:
                for i in range(REPEATS + 1):
                    last = i % 2
                    t0 = time.perf_counter()
                    received = push(models[last])
                    if i:  # the first push is untimed (groups, plans, mappings)
                        seconds.append(time.perf_counter() - t0)
            finally:
                close()
            tokens = _greedy(server.url, server.model_name)
            if tokens != expected[last]:
                raise RuntimeError(
                    f"{kind}: the server generates {tokens}, the pushed checkpoint {expected[last]}"
                )
            kinds[kind] = {
                "seconds_best": round(min(seconds), 4),
                "seconds_median": round(statistics.median(seconds), 4),
                "bytes_received_by_engine_ranks": received,
                "gb_per_s": round(nbytes / min(seconds) / 1e9, 3),
            }
    finally:
        server.stop()
    shm = kinds["shm"]
    ratios = {
        f"{k}_seconds_vs_shm": round(v["seconds_best"] / shm["seconds_best"], 3)
        for k, v in kinds.items()
        if k != "shm"
    }
    ratios["broadcast_bytes_received_vs_shm"] = round(
        kinds["broadcast"]["bytes_received_by_engine_ranks"]
        / shm["bytes_received_by_engine_ranks"],
        3,
    )
    return {
        "model_bytes": nbytes,
        "engine": "tandem serve, TP=2, float32",
        "repeats": REPEATS,
        "kinds": kinds,
        "ratios": ratios,
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"model: {result['model_bytes'] / 2**20:.0f} MiB into {result['engine']}"]
    for kind, k in result["kinds"].items():
        lines.append(
            f"{kind}: {k['seconds_best']:.3f} s best, {k['gb_per_s']} GB/s, "
            f"{k['bytes_received_by_engine_ranks'] / 2**20:.0f} MiB into the ranks"
        )
    lines += [f"{k}: {v}" for k, v in result["ratios"].items()]
    return "\n".join(lines)

"""`tandem bench fleet --rolling`: a fleet of 3 replicas under a steady request load while the
trainer pushes, stop-the-world against rolling. Measured in one run, on this host:

- the generate bench's model (`tandem.bench.generate.SETUPS`) served by
  ``LLM(data_parallel_size=3, dtype="float32")`` in this process; ``CLIENTS`` client threads
  each loop `LLM.generate` on one request of ``NEW_TOKENS`` sampled tokens (a bounded load:
  that many requests in flight);
- the trainer: the same model in transformers, in this process, pushing with ``shm`` (staged)
  back to back for ``WINDOW_S`` seconds, each push a new version of the same weights (so the
  bytes moved and checked are a full push's every time);
- ``steady``: tokens per second with no push; ``all``: while pushes with ``policy="all"``
  run back to back (every replica paused for each verify + commit); ``rolling``: while pushes
  with ``policy="rolling", max_unavailable=1`` run back to back, each waiting until every
  replica serves its version (waves drain their requests first: ``wave="wait"``). Tokens are
  counted by the requests that finished inside the window. ``rollout_seconds``: from a push's
  start until every replica serves its version (mean). ``failed_requests``: client calls that
  raised (goal: 0);
- ``fault``: one replica's worker is killed (SIGKILL) just before a push: the seconds from the
  push's start until that replica is quarantined and until the push returned with the others
  committed, then until it serves again (restarted, reading nothing from disk, filled from a
  peer), and whether its greedy outputs then equal its peers'.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from typing import Any

import torch

from tandem.bench.generate import SETUPS as GENERATE_SETUPS
from tandem.bench.generate import bench_model_dir
from tandem.bench.load import ClientLoad, back_to_back, wait_serving

REPLICAS = 3
CLIENTS = 6
NEW_TOKENS = 32
WINDOW_S = {False: 8.0, True: 3.0}


def _clients(llm, vocab: int) -> ClientLoad:
    """``CLIENTS`` threads looping one sampled request each (16 random prompt ids)."""
    from tandem import SamplingParams

    def call(client: int, rng) -> int:
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.8, ignore_eos=True, seed=client
        )
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        return len(llm.generate([prompt], params)[0].outputs[0].token_ids)

    return ClientLoad(CLIENTS, call)


def _serving(llm, version: int, timeout_s: float = 120.0) -> None:
    wait_serving(llm.fleet_state, version, timeout_s, poll_s=0.002)


def _pushes(llm, sender, policy: str, window_s: float, version: int):
    """Push back to back for ``window_s``: (window start, end, next version, rollout seconds
    per push)."""

    def push(v: int) -> None:
        sender.push(version=v, policy=policy, max_unavailable=1, delta=False)
        _serving(llm, v)

    return back_to_back(push, window_s, version)


def run(quick: bool = False) -> dict[str, Any]:
    import transformers

    from tandem import LLM, SamplingParams
    from tandem.exchange import WeightSender

    setup = GENERATE_SETUPS[quick]
    path = bench_model_dir(setup)
    window = WINDOW_S[quick]
    trainer = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    vocab = trainer.config.vocab_size
    result: dict[str, Any] = {
        "benchmark": "fleet-rolling",
        "quick": quick,
        "model": str(path),
        "replicas": REPLICAS,
        "clients": CLIENTS,
        "new_tokens": NEW_TOKENS,
        "window_s": window,
    }
    with LLM(
        str(path), data_parallel_size=REPLICAS, dtype="float32", kv_cache_memory=128 << 20
    ) as llm:
        sender = WeightSender(trainer, llm, transport="shm")
        sender.push(version=1, delta=False)  # warm-up: the staging memory, the plan
        clients = _clients(llm, vocab)
        time.sleep(min(2.0, window / 2))  # the load settles
        start = time.monotonic()
        time.sleep(window)
        steady = clients.tokens_per_s(start, time.monotonic())
        a0, a1, version, all_rollouts = _pushes(llm, sender, "all", window, 2)
        r0, r1, version, rolling_rollouts = _pushes(llm, sender, "rolling", window, version)
        clients.stop(120)
        during_all = clients.tokens_per_s(a0, a1)
        during_rolling = clients.tokens_per_s(r0, r1)
        result["tokens_per_s"] = {
            "steady": round(steady, 1),
            "all": round(during_all, 1),
            "rolling": round(during_rolling, 1),
        }
        result["pushes"] = {"all": len(all_rollouts), "rolling": len(rolling_rollouts)}
        result["rollout_seconds"] = {
            "all": round(statistics.mean(all_rollouts), 4),
            "rolling": round(statistics.mean(rolling_rollouts), 4),
        }
        result["failed_requests"] = len(clients.failed)
        result["failures"] = clients.failed[:3]
        result["fault"] = _fault(llm, sender, version, SamplingParams)
    result["ratios"] = {
        "rolling_vs_steady": round(during_rolling / steady, 3),
        "all_vs_steady": round(during_all / steady, 3),
        "rolling_vs_all": round(during_rolling / during_all, 3) if during_all else None,
    }
    result["targets"] = {
        "rolling_vs_steady >= 0.6": result["ratios"]["rolling_vs_steady"] >= 0.6,
        "failed_requests == 0": result["failed_requests"] == 0,
        "quarantined within 5 s": result["fault"]["quarantined_s"] < 5,
        "rejoined equal to peers": result["fault"]["rejoined_equal"],
    }
    return result


def _fault(llm, sender, version: int, sampling) -> dict[str, Any]:
    """Kill replica 2's worker, push, time the quarantine, the push and the healing."""
    pid = next(w["pid"] for w in llm.worker_locations() if w["replica"] == REPLICAS - 1)
    quarantined: list[float] = []

    def watch() -> None:
        while not quarantined:
            if llm.fleet.board.state(REPLICAS - 1).value == "quarantined":
                quarantined.append(time.monotonic())
            time.sleep(0.001)

    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stats = sender.push(version=version, delta=False)
    pushed = time.monotonic() - t0
    watcher.join(30)
    _serving(llm, version)
    healed = time.monotonic() - t0
    prompts = [[5, 9, 33, 2, 17, 40, 8, 1]] * (2 * REPLICAS)
    params = sampling(max_tokens=8, temperature=0, ignore_eos=True)
    llm.reset_prefix_cache()
    outs = llm.generate(prompts, params)
    by_replica = {o.replica: o.outputs[0].token_ids for o in outs}
    return {
        "committed": [r.replica for r in stats.replicas if r.state == "committed"],
        "failed": stats.failed,
        "quarantined_s": round(quarantined[0] - t0, 3) if quarantined else None,
        "push_s": round(pushed, 3),
        "healed_s": round(healed, 3),
        "rejoined_equal": (
            len(by_replica) == REPLICAS and len({tuple(v) for v in by_replica.values()}) == 1
        ),
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"{k}: {v}x" for k, v in result["ratios"].items()]
    lines.append(
        f"tokens/s: {result['tokens_per_s']}; rollout s: {result['rollout_seconds']}; "
        f"failed requests: {result['failed_requests']}"
    )
    lines.append(f"fault: {result['fault']}")
    lines.append(f"targets: {result['targets']}")
    return "\n".join(lines)

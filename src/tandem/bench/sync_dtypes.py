"""`tandem bench sync --engine-dtypes`: the same float32 FSDP2 trainer pushing into engines of
each dtype: float32, bfloat16 and block-FP8 (``quantization="fp8"``: e4m3 values + one float32
scale per 128 x 128 block; the trainer ranks agree on the scales, then quantize their boxes).

Per engine (``LLM(tensor_parallel_size=2)`` in this process), `tandem.bench.sync_pushes` runs
its 2 trainer processes in the modes ``shm`` (staged) and ``dist`` (staged): one untimed push,
then ``REPEATS`` timed, each carrying new weights. ``bytes_needed`` is what the engine's ranks
hold (counted from their layouts) and ``bytes_moved`` what the transports counted as they
wrote or sent. After every push, untimed, the engine's greedy output is scored against a
reference of the trainer's weights as that engine must hold them: float32 as they are,
block-FP8 quantized and dequantized by the reference rule (both computed in float32: the
engine's log-probs must agree within `sync_pushes.TOLERANCE`), bfloat16 rounded to bfloat16
(the engine computes in bfloat16, the reference in float32: within ``BF16_TOLERANCE``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from tandem.bench.phases import Phases
from tandem.bench.sync import KV_CACHE_MEMORY, bench_model, push_figures, weights_of
from tandem.bench.sync_baselines import REPEATS
from tandem.bench.sync_pushes import NEW_TOKENS, PROMPT, TOLERANCE, Reference, run_pushes
from tandem.layers.fp8 import dequantize_blocks, quantize_blocks

MODES = ("shm", "dist")
# engine -> (LLM options, the tolerance its check holds it to)
BF16_TOLERANCE = 0.25  # bfloat16 matmuls on a 32k vocabulary: 0.09 seen
ENGINES: dict[str, tuple[dict[str, Any], float]] = {
    "float32": ({"dtype": "float32"}, TOLERANCE),
    "bfloat16": ({"dtype": "bfloat16"}, BF16_TOLERANCE),
    "fp8": ({"dtype": "float32", "quantization": "fp8"}, TOLERANCE),
}


def _as_held(reference: Reference, engine: str, fp8_names: set[str]) -> torch.nn.Module:
    """The reference's model with its weights as engine ``engine`` holds them."""
    if engine == "float32":
        return reference.model
    model = copy.deepcopy(reference.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if engine == "bfloat16":
                p.copy_(p.to(torch.bfloat16))
            elif name in fp8_names:
                p.copy_(dequantize_blocks(*quantize_blocks(p)))
    return model


def _check(llm, engine: str, tolerance: float, fp8_names: set[str]):
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)

    def check(reference: Reference, version: int) -> float:
        out = llm.generate([PROMPT], params)[0]
        if out.weight_version != version:
            raise RuntimeError(
                f"{engine} engine served version {out.weight_version} after push {version}"
            )
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        model = _as_held(reference, engine, fp8_names)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + tokens])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)[len(PROMPT) - 1 : -1]
        expected = logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        error = float((torch.tensor(logprobs) - expected).abs().max())
        if error > tolerance:
            raise RuntimeError(
                f"after push {version} the {engine} engine's log-probs differ from the "
                f"trainer's weights as it holds them by {error:.3g}"
            )
        return error

    return check


def run(quick: bool = False) -> dict[str, Any]:
    from tandem import LLM
    from tandem.layers.linear import fp8_blocks

    phases = Phases()
    path = bench_model(quick)
    params, weight_bytes = weights_of(path)
    timeout = 120.0 if quick else 600.0
    result: dict[str, Any] = {
        "benchmark": "sync_engine_dtypes",
        "quick": quick,
        "model": {"params": params, "bytes": weight_bytes, "dtype": "float32"},
        "trainer": {"ranks": 2, "sharding": "FSDP2", "backend": "gloo", "dtype": "float32"},
        "engine": {"tensor_parallel_size": 2, "kv_cache_memory": KV_CACHE_MEMORY},
        "repeats": REPEATS,
        "threads": torch.get_num_threads(),
        "bf16_tolerance": BF16_TOLERANCE,
    }
    for engine, (options, tolerance) in ENGINES.items():
        with LLM(
            str(path), tensor_parallel_size=2, kv_cache_memory=KV_CACHE_MEMORY, **options
        ) as llm:
            names = set(fp8_blocks(_whole_model(path))) if engine == "fp8" else set()
            ranks, checks = run_pushes(
                llm.exchange_address,
                path,
                REPEATS,
                timeout,
                _check(llm, engine, tolerance, names),
                MODES,
            )
            checks["tolerance"] = tolerance  # this engine's, not float32's
        pushes = {mode: push_figures(per_rank) for mode, per_rank in ranks.items()}
        needed = {p["bytes_needed"] for p in pushes.values()}
        if len(needed) != 1:
            raise RuntimeError(f"{engine}: push modes disagree on bytes_needed: {pushes}")
        result[engine] = {
            "options": options,
            "bytes_needed": needed.pop(),
            "shm": pushes["shm"],
            "dist": pushes["dist"],
            "checks": checks,
        }
        phases.lap(engine)
    result["fp8"]["linear_weights"] = _fp8_part(path)
    f32 = result["float32"]
    result["ratios"] = {}
    for engine in ("bfloat16", "fp8"):
        mine = result[engine]
        result["ratios"][f"{engine}_bytes_vs_float32"] = round(
            mine["bytes_needed"] / f32["bytes_needed"], 4
        )
        for mode in MODES:
            result["ratios"][f"{engine}_{mode}_seconds_vs_float32"] = round(
                mine[mode]["seconds"] / f32[mode]["seconds"], 3
            )
    part = result["fp8"]["linear_weights"]
    result["ratios"]["fp8_linear_bytes_vs_float32"] = round(
        part["bytes"] / part["float32_bytes"], 4
    )
    result["phase_seconds"] = phases.seconds
    return result


def _fp8_part(path) -> dict[str, int]:
    """The weights an FP8 engine holds as FP8: their count, their bytes there (one per
    weight, four per block scale) and in float32."""
    from tandem.layers.fp8 import grid_shape
    from tandem.layers.linear import fp8_blocks
    from tandem.layers.placement import canonical_shapes

    model = _whole_model(path)
    shapes = canonical_shapes(model)
    blocks = fp8_blocks(model)
    count = sum(shapes[n][0] * shapes[n][1] for n in blocks)
    scales = sum(math.prod(grid_shape(shapes[n], b)) for n, b in blocks.items())
    return {
        "params": count,
        "scales": scales,
        "bytes": count + 4 * scales,
        "float32_bytes": 4 * count,
    }


def _whole_model(path):
    """The engine's model for one rank, on meta (only its layers' FP8 flags are read)."""
    from tandem.models.fp8 import quantize_layers
    from tandem.models.loader import read_model_spec

    spec = read_model_spec(path, "fp8")
    with torch.device("meta"):
        model = spec.cls(spec.config)
        quantize_layers(model, spec.fp8)
    return model


def summary(result: dict[str, Any]) -> str:
    lines = []
    for engine in ENGINES:
        r = result[engine]
        lines.append(
            f"{engine}: {r['bytes_needed'] / 2**20:.1f} MiB needed; shm "
            f"{r['shm']['seconds']:.3f} s, dist {r['dist']['seconds']:.3f} s"
        )
    lines += [f"{k}: {v:.3f}" for k, v in result["ratios"].items()]
    return "\n".join(lines)

"""`tandem bench generate --quick`: the result has the documented shape and counts."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.generate import SETUPS, SMOL_VOCAB, run
from tandem.bench.generate_peers import STATIC_BATCH_SIZES
from tandem.bench.generate_vllm import vllm_python


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_quick_generate_bench_shape(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the model is cached under ./.tandem
    result = run(quick=True, vllm=False)  # with vLLM: test_quick_generate_bench_with_vllm
    json.dumps(result)  # serialisable as the CLI prints it
    assert result["benchmark"] == "generate" and result["quick"] is True
    assert (tmp_path / ".tandem/bench-llama-quick/config.json").is_file()
    assert set(result["model"]) >= {"params", "hidden", "layers", "heads", "kv_heads", "vocab"}
    assert all(_positive(result["model"][k]) for k in ("params", "hidden", "layers", "vocab"))
    assert isinstance(result["threads"], int) and result["threads"] >= 1
    setup = SETUPS[True]
    prompts, n, _, _, new = setup.grpo
    assert result["batch1"]["tokens"] == setup.batch1[1]
    assert result["mixed"]["requests"] == setup.mixed[0]
    assert result["grpo"]["requests"] == prompts and result["grpo"]["tokens"] == prompts * n * new
    sides = {
        "batch1": ("tandem", "transformers"),
        "mixed": ("tandem", "transformers", "transformers_cb"),
        "grpo": ("tandem", "tandem_no_prefix_caching", "transformers_cb"),
    }
    for name, names in sides.items():
        entry = result[name]
        assert _positive(entry["tokens"])
        for side in names:  # every run of every side was checked request by request
            assert entry[f"{side}_tokens_counted"] == entry["tokens"], (name, side)
            assert _positive(entry[f"{side}_tokens_per_s"]), (name, side)
    mixed = result["mixed"]
    sizes = {str(min(b, mixed["requests"])) for b in STATIC_BATCH_SIZES}
    assert set(mixed["transformers_batch_seconds"]) == sizes
    assert str(mixed["transformers_batch_size"]) in sizes
    for name in ("mixed", "grpo"):
        assert _positive(result[name]["transformers_cb_config"]["num_blocks"])
    assert set(result["ratios"]) == {
        "batch1_vs_transformers",
        "mixed_vs_transformers",
        "mixed_vs_transformers_cb",
        "grpo_vs_transformers_cb",
        "prefix_sharing",
        "continuous_vs_static",
    }
    batching = result["batching"]
    for mode in ("continuous", "static"):
        assert batching[mode]["tokens"] == result["mixed"]["tokens"]
        assert 0 < batching[mode]["latency_mean_s"] <= batching[mode]["latency_p99_s"]
        assert _positive(batching[mode]["tokens_per_s"])
    assert all(_positive(v) for v in result["ratios"].values())
    grpo = result["grpo"]
    ratio = grpo["tandem_tokens_per_s"] / grpo["tandem_no_prefix_caching_tokens_per_s"]
    assert result["ratios"]["prefix_sharing"] == pytest.approx(ratio, rel=1e-2)
    ratio = result["batch1"]["tandem_tokens_per_s"] / result["batch1"]["transformers_tokens_per_s"]
    assert result["ratios"]["batch1_vs_transformers"] == pytest.approx(ratio, rel=1e-2)
    assert result["vllm"] == {"skipped": "--no-vllm"}
    for name, names in sides.items():
        compute = result[name]["compute"]
        assert _positive(compute["peak_gflops"]) and _positive(compute["model_flops"])
        assert compute["dtype"] == "float32"
        assert all(_positive(compute[f"{side}_fraction_of_peak"]) for side in names)
    bf16 = result["bf16"]
    if "skipped" in bf16:  # a CPU without native bf16
        assert "bf16" in bf16["skipped"]
    else:
        for name in sides:
            assert bf16[name]["tandem_tokens_counted"] == result[name]["tokens"]
            assert bf16[name]["compute"]["dtype"] == "bfloat16"
            assert "vllm_tokens_per_s" not in bf16[name]
    smol = result["smol"]  # the second shape: 49k vocabulary, tied
    assert smol["model"]["vocab"] == SMOL_VOCAB and smol["model"]["tied"] is True
    for dtype in ("float32",) + (() if "skipped" in bf16 else ("bfloat16",)):
        for name in sides:
            entry = smol[dtype][name]
            assert entry["tandem_tokens_counted"] == entry["tokens"] > 0
            assert entry["compute"]["dtype"] == dtype
    kernels = result["gemm_kernels"]  # the run's matmul kernels, as the engines chose them
    assert kernels["float32/batch"] in ("onednn", "torch") and kernels["float32/one"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(vllm_python() is None, reason="no .venv-vllm: run `make vllm`")
def test_quick_generate_bench_with_vllm(tmp_path, monkeypatch):
    """vLLM as one more side of every scenario, in float32 and, where the CPU has it, bf16."""
    monkeypatch.chdir(tmp_path)
    result = run(quick=True)
    json.dumps(result)
    assert result["vllm"]["enable_prefix_caching"] is True
    assert result["vllm"]["dtype"] == "float32"
    scenarios = [result]
    if "skipped" not in result["bf16"]:
        scenarios.append(result["bf16"])
        assert result["bf16"]["vllm"]["dtype"] == "bfloat16"
    dtypes = ("float32", "bfloat16")
    for scenario, suffix in zip(scenarios, ("", "_bf16"), strict=False):
        smol = result["smol"][dtypes[suffix == "_bf16"]]  # the second shape's, same dtype
        for name in ("batch1", "mixed", "grpo"):
            for entry, prefix in ((scenario[name], ""), (smol[name], "smol_")):
                assert entry["vllm_tokens_counted"] == entry["tokens"]
                assert 0 < entry["vllm_seconds"] <= entry["vllm_round_trip_seconds"]
                assert _positive(entry["compute"]["vllm_fraction_of_peak"])
                ratio = entry["tandem_tokens_per_s"] / entry["vllm_tokens_per_s"]
                key = f"{prefix}{name}_vs_vllm{suffix}"
                assert result["ratios"][key] == pytest.approx(ratio, rel=1e-2)


def test_transformers_cb_checks_token_counts():
    """A short or failed request makes the continuous-batching side raise, not count."""
    from types import SimpleNamespace

    from tandem.bench.generate_peers import _check

    ok = SimpleNamespace(error=None, generated_tokens=[1, 2, 3])
    assert _check([ok, ok], [3, 3]) == 6
    short = SimpleNamespace(error=None, generated_tokens=[1, 2])
    failed = SimpleNamespace(error="boom", generated_tokens=[1, 2, 3])
    for results in ([ok, short], [ok, failed], [ok, None], [ok]):
        with pytest.raises(RuntimeError, match="asked"):
            _check(results, [3, 3])


@pytest.mark.timeout(300)
def test_quick_moe_generate_bench_through_the_cli(tmp_path, monkeypatch, capsys):
    from tandem.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "generate", "--model-family", "qwen3_moe", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_family"] == "qwen3_moe" and result["model"]["experts"] == 8
    for name in ("batch1", "mixed"):
        for side in ("tandem", "transformers"):
            assert result[name][f"{side}_tokens_counted"] == result[name]["tokens"]
    assert set(result["ratios"]) == {"moe_batch1_vs_transformers", "moe_mixed_vs_transformers"}
    assert all(_positive(v) for v in result["ratios"].values())


@pytest.mark.timeout(300)
def test_quick_profile_splits_each_run_into_parts_that_add_up(tmp_path, monkeypatch):
    """`tandem bench generate --profile --quick`: every run's time split into non-negative
    parts (a part matched twice or not at all would push another below zero), the LM head a
    larger share on the 49k-vocabulary shape than on the bench model's 1k vocabulary."""
    from tandem.bench.generate_profile import PARTS
    from tandem.bench.generate_profile import run as profile

    monkeypatch.chdir(tmp_path)
    result = profile(quick=True)
    json.dumps(result)
    assert result["benchmark"] == "generate-profile" and set(result["shapes"]) == {"bench", "smol"}
    setup = SETUPS[True]
    prompts, n, _, _, new = setup.grpo
    parts = {*PARTS, "rest_of_step", "outside_step"}
    for name, entry in result["shapes"].items():
        for dtype in result["dtypes"]:
            mixed, grpo = entry[f"mixed_{dtype}"], entry[f"grpo_{dtype}"]
            assert grpo["tokens"] == prompts * n * new
            for figures in (mixed, grpo):
                assert set(figures["fraction"]) == parts, name
                assert all(v >= 0 for v in figures["fraction"].values()), (name, figures)
                assert abs(sum(figures["fraction"].values()) - 1) < 0.01
                assert figures["fraction"]["matmul"] > 0 and figures["steps"] > 0
    for dtype in result["dtypes"]:
        smol = result["shapes"]["smol"][f"mixed_{dtype}"]["fraction"]["lm_head"]
        assert smol > result["shapes"]["bench"][f"mixed_{dtype}"]["fraction"]["lm_head"]

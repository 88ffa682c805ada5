"""The `tandem` command as a user runs it (real subprocesses)."""

import json
import subprocess
import sys

import pytest

TANDEM = [sys.executable, "-m", "tandem.cli"]


def _run(*args, check=True):
    return subprocess.run(
        [*TANDEM, *args], capture_output=True, text=True, timeout=240, check=check
    )


@pytest.mark.timeout(300)
def test_make_tiny_model_then_generate(tmp_path):
    model = tmp_path / "qwen3"
    made = _run("make-tiny-model", str(model), "--family", "qwen3", "--seed", "3")
    assert "qwen3" in made.stdout
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    out = _run(
        "generate",
        "--model",
        str(model),
        "--prompt",
        "Hello",
        "--prompt",
        "1 + 1 =",
        "--max-tokens",
        "5",
        "--logprobs",
    )
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "1 + 1 ="]
    assert all(
        len(r["token_ids"]) <= 5 and len(r["logprobs"]) == len(r["token_ids"]) for r in records
    )


@pytest.mark.timeout(120)
def test_bad_model_dir_is_a_one_line_error(tmp_path):
    result = _run("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_serve_with_a_hub_id_says_to_download_it(tmp_path):
    done = subprocess.run(
        [*TANDEM, "serve", "--model", "Qwen/Qwen2.5-0.5B", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "looks like a Hugging Face hub id" in done.stderr
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir" in done.stderr


@pytest.mark.timeout(120)
def test_engine_never_imports_transformers(llama_dir):
    code = (
        "import sys; from tandem import LLM, SamplingParams; import tandem.cli; "
        f"LLM({llama_dir!r}).generate('hi', SamplingParams(max_tokens=2)); "
        "assert 'transformers' not in sys.modules, 'engine imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)

"""`tandem serve` settings: TOML file + flags, typed; bad keys are errors that name them."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from support.paths import REPO
from tandem.server.config import ConfigError, load_config


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return str(path)


def test_file_and_flags_merge(tmp_path):
    path = _write(
        tmp_path,
        'model = "m"\ntp = 2\nport = 9000\n[engine]\ndtype = "float32"\nmax_num_seqs = 8\n',
    )
    config = load_config(path, {"port": 9100, "engine": {"max_num_seqs": 4}})
    assert (config.model, config.tp, config.port, config.host) == ("m", 2, 9100, "127.0.0.1")
    engine = SimpleNamespace(**config.engine_config().flat())
    assert engine.tensor_parallel_size == 2 and engine.max_num_seqs == 4
    assert engine.dtype == "float32"
    assert config.admin_key is None  # admin routes off unless a key is given


def test_engine_flags_reach_the_engine_config():
    from tandem.cli import parser
    from tandem.server.serve_args import serve_config

    args = parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--max-num-batched-tokens",
            "64",
            "--no-enable-prefix-caching",
            "--batching",
            "static",
        ]
    )
    engine = SimpleNamespace(**serve_config(args).engine_config().flat())
    assert engine.max_num_batched_tokens == 64 and engine.enable_prefix_caching is False
    assert engine.batching == "static"
    default = serve_config(parser().parse_args(["serve", "--model", "m"])).engine_config().flat()
    default = SimpleNamespace(**default)
    assert default.enable_prefix_caching is True and default.max_num_batched_tokens is None


@pytest.mark.parametrize(
    "text,named",
    [
        ('model = "m"\nbogus = 1\n', "unknown key `bogus`"),
        ('model = "m"\ntp = "2"\n', "`tp`"),
        ('model = "m"\nport = 70000\n', "`port`"),
        ('model = "m"\n[engine]\ndtype = "float64"\n', "`engine.dtype`"),
        ('model = "m"\n[engine]\nmax_num_seqs = 1.5\n', "`engine.max_num_seqs`"),
        ('model = "m"\n[engine]\nwarp_speed = 9\n', "unknown key `engine.warp_speed`"),
        ('model = "m"\n[engine]\ntensor_parallel_size = 2\n', "engine.tensor_parallel_size"),
        ("tp = 1\n", "`model` is required"),
        ('model = "m"\nadmin_key = "short"\n', "`admin_key`"),
        ("model = [\n", "not valid TOML"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, text, named):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text), {})
    assert named in str(err.value)
    assert "serve.toml" in str(err.value)


@pytest.mark.timeout(60)
def test_cli_reports_a_bad_config_and_exits_2(tmp_path):
    path = _write(tmp_path, 'model = "m"\nmax_waiting_requests = "many"\n')
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--config", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "`max_waiting_requests`" in done.stderr


def _serve_config(argv: list[str]):
    """What `tandem serve ARGV` would run with (parsed as `tandem.cli.main` parses)."""
    from tandem.cli import parser
    from tandem.server.serve_args import serve_config
    from tandem.server.vllm_flags import dashed

    args, unknown = parser().parse_known_args(["serve", *dashed(argv)])
    assert not unknown, unknown
    return serve_config(args)


def test_vllm_spellings_give_the_same_settings(capsys):
    vllm = _serve_config(
        [
            "m",
            "-tp",
            "2",
            "-pp",
            "2",
            "--max_model_len",
            "256",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens=64",
            "--kv-cache-memory-bytes",
            "1048576",
            "--block-size",
            "8",
            "--dtype",
            "float",
            "--disable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--served-model-name",
            "tiny",
            "--distributed-timeout-seconds",
            "30",
            "--seed",
            "3",
            "--uvicorn-log-level",
            "trace",
            "--runner",
            "pooling",
            "--convert",
            "embed",
            "-n",
            "1",
            "-r",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29555",
            "--distributed-executor-backend",
            "mp",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--load-format",
            "safetensors",
            "--kv-cache-dtype",
            "auto",
            "--shutdown-timeout",
            "5",
        ]
    )
    tandem = _serve_config(
        [
            "--model",
            "m",
            "--tp",
            "2",
            "--pp",
            "2",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--kv-cache-memory",
            "1048576",
            "--block-size",
            "8",
            "--dtype",
            "float32",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--served-model-name",
            "tiny",
            "--distributed-timeout-seconds",
            "30",
            "--seed",
            "3",
            "--log-level",
            "debug",
            "--task",
            "embed",
            "--nnodes",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29555",
            "--port",
            "0",
            "--distributed-executor-backend",
            "mp",
            "--host",
            "127.0.0.1",
            "--shutdown-timeout",
            "5",
        ]
    )
    assert vllm == tandem
    engine = SimpleNamespace(**vllm.engine_config().flat())
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size) == (2, 2)
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (
        256,
        8,
        64,
    )
    assert (engine.kv_cache_memory, engine.block_size, engine.dtype) == (1 << 20, 8, "float32")
    assert engine.enable_prefix_caching is False and engine.scheduling_policy == "priority"
    assert (engine.collective_timeout_s, engine.seed, engine.task) == (30.0, 3, "embed")
    assert (vllm.model_name, vllm.log_level, vllm.shutdown_timeout_s) == ("tiny", "debug", 5.0)
    assert _serve_config(["m", "--log-level", "WARNING"]).log_level == "warning"
    assert capsys.readouterr().err == ""  # nothing taken was ignored


IGNORED = [
    ["--gpu-memory-utilization", "0.9"],
    ["--enforce-eager"],
    ["--trust-remote-code"],
    ["--enable-sleep-mode"],
    ["--disable-log-requests"],
    ["-cc", '{"level": 3}'],
    ["--no-async-scheduling"],
    ["--enable-chunked-prefill"],
]


@pytest.mark.parametrize("flag", IGNORED, ids=lambda f: f[0])
def test_vllm_flags_without_effect_are_ignored_with_a_warning(flag, capsys):
    assert _serve_config(["m", *flag]) == _serve_config(["m"])
    assert f"ignoring vLLM's {flag[0]}: " in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["m", "--quantization-config", "{}"], "unsupported option --quantization-config"),
        (
            ["m", "--lora-dtype", "auto", "--max-cpu-loras", "4"],
            "unsupported options --lora-dtype, --max-cpu-loras",
        ),
        (["m", "--speculative-config", "{}"], "unsupported option --speculative-config"),
        (["m", "--load-format", "dummy"], "--load-format dummy: tandem supports only"),
        (["m", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: tandem supports only"),
    ],
)
def test_vllm_flags_tandem_lacks_are_refused_by_name(argv, message, capsys):
    from tandem.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_cache_memory_takes_bytes_or_a_fraction(capsys):
    """As the help and docs say: an integer is bytes, a fraction (0, 1] of free memory."""
    for given, taken in (("0.05", 0.05), ("1048576", 1 << 20), ("1e9", 10**9), ("1", 1)):
        kv = _serve_config(["m", "--kv-cache-memory", given]).engine_config().flat()
        assert (kv["kv_cache_memory"], type(kv["kv_cache_memory"])) == (taken, type(taken))
    with pytest.raises(ConfigError, match="kv_cache_memory.*fraction"):
        _serve_config(["m", "--kv-cache-memory-bytes", "1.5"])
    with pytest.raises(SystemExit):
        _serve_config(["m", "--kv-cache-memory", "lots"])
    assert "give bytes (an integer) or a fraction" in capsys.readouterr().err


def test_serve_help_shows_no_internal_placeholders():
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--gpu-memory-utilization VALUE" in done.stdout
    assert "SUPPRESS" not in done.stdout and "--load-format {auto,safetensors}" in done.stdout


def test_a_check_across_settings_has_no_empty_label():
    with pytest.raises(ConfigError) as err:
        _serve_config(["m", "--enable-lora", "--data-parallel-size", "2"])
    assert str(err.value) == (
        "command line: enable_lora with data_parallel_size > 1 is not supported yet"
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["m", "--model", "other"], "two models given"),
        (["m", "--served-model-name", "a", "b"], "tandem serves one name"),
        (["m", "--runner", "pooling"], "give --convert"),
        (["m", "--task", "classify", "--convert", "embed"], "differ"),
    ],
)
def test_vllm_spellings_that_clash_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        _serve_config(argv)


def test_generate_takes_vllms_parallel_spellings():
    from tandem.cli import parser

    args = parser().parse_args(
        ["generate", "--model", "m", "--prompt", "x", "-tp", "2", "--pipeline-parallel-size", "2"]
    )
    assert (args.tp, args.pp) == (2, 2)


def test_docs_list_the_vllm_flags_as_the_parser_treats_them():
    """docs/serving.md's "vLLM's flags": every ignored spelling is named there, and every flag
    listed as refused is one `tandem serve` does not take."""
    import re

    from tandem.cli import parser
    from tandem.server.vllm_flags import IGNORED

    docs = (REPO / "docs" / "serving.md").read_text()
    section = docs.split("## vLLM's flags", 1)[1].split("\n## ", 1)[0]
    ignored, refused = section.split("**Ignored", 1)[1].split("**Refused**", 1)
    for flag in IGNORED:
        for spelling in flag.spellings:
            assert f"`{spelling}`" in ignored, spelling
    serve = parser()._subparsers._group_actions[0].choices["serve"]
    listed = re.findall(r"`(--[a-z0-9-]+)`", refused.split("\n\n", 1)[1])
    assert len(listed) > 250
    taken = [flag for flag in listed if flag in serve._option_string_actions]
    assert not taken, f"listed as refused but taken: {taken}"

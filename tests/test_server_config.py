"""`tandem serve` settings: TOML file + flags, typed; bad keys are errors that name them."""

import subprocess
import sys

import pytest

from tandem.server.config import ConfigError, load_config


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return str(path)


def test_file_and_flags_merge(tmp_path):
    path = _write(tmp_path, 'model = "m"\ntp = 2\nport = 9000\n[engine]\ndtype = "float32"\n'
                  "max_num_seqs = 8\n")  # fmt: skip
    config = load_config(path, {"port": 9100, "engine": {"max_num_seqs": 4}})
    assert (config.model, config.tp, config.port, config.host) == ("m", 2, 9100, "127.0.0.1")
    engine = config.engine_config()
    assert engine.tensor_parallel_size == 2 and engine.max_num_seqs == 4
    assert engine.dtype == "float32"
    assert config.admin_key is None  # admin routes off unless a key is given


def test_engine_flags_reach_the_engine_config():
    from tandem.cli import parser, serve_config

    args = parser().parse_args(["serve", "--model", "m", "--max-num-batched-tokens", "64",
                                "--no-enable-prefix-caching", "--batching", "static"])  # fmt: skip
    engine = serve_config(args).engine_config()
    assert engine.max_num_batched_tokens == 64 and engine.enable_prefix_caching is False
    assert engine.batching == "static"
    default = serve_config(parser().parse_args(["serve", "--model", "m"])).engine_config()
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
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--config", path],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "`max_waiting_requests`" in done.stderr

"""`tandem bench` is built from the scenario registry: every scenario is reachable from the CLI,
each documented command line selects the scenario it always ran, and a combination no scenario
has is refused with a message naming the choices. No bench runs here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.bench import registry
from tandem.cli import main, parser


def _selected(*argv: str) -> tuple[registry.Scenario, dict]:
    args = parser().parse_args(["bench", *argv])
    return registry.select(args.what, vars(args)), vars(args)


def test_names_and_command_lines_are_unique():
    every = registry.scenarios()
    assert len(every) >= 12
    assert len({s.name for s in every}) == len(every)
    assert len({registry.command_line(s) for s in every}) == len(every)
    assert all(s.description and "\n" not in s.description for s in every)


@pytest.mark.parametrize("scenario", registry.scenarios(), ids=lambda s: s.name)
def test_every_scenario_is_reachable_from_the_cli(scenario):
    assert scenario.command in registry.commands()
    selected, _ = _selected(*registry.argv(scenario))
    assert selected is scenario
    assert registry.get(scenario.name) is scenario
    with_common, _ = _selected(*registry.argv(scenario), "--json", "--quick")
    assert with_common is scenario


# the command lines of README.md, docs/, the Makefile and the tests, and what each runs with
DOCUMENTED = [
    ("generate --json", "generate", {"tp": 1, "pp": 1, "vllm": True}),
    ("generate --quick --no-vllm --tp 2 --json", "generate", {"tp": 2, "pp": 1, "vllm": False}),
    ("generate --json --pp 2", "generate", {"tp": 1, "pp": 2, "vllm": True}),
    ("generate --model-family llama", "generate", {"tp": 1, "pp": 1, "vllm": True}),
    ("generate --model-family qwen3_moe --tp 2 --json", "generate-moe", {"tp": 2, "pp": 1}),
    ("generate --engine-dtypes --json", "generate-dtypes", {}),
    ("generate --lora --quick --json", "generate-lora", {}),
    ("generate --profile --json", "generate-profile", {}),
    ("serve --quick --json", "serve", {"tp": 1, "pp": 1}),
    ("sync --quick --json", "sync", {}),
    ("sync --into tandem", "sync", {}),
    ("sync --into vllm --json", "sync-vllm", {}),
    ("sync --into serve --json", "sync-serve", {}),
    ("sync --engine-dtypes --json", "sync-dtypes", {}),
    ("encode --json", "encode", {"tp": 1}),
    ("fleet --json", "fleet", {}),
    ("fleet --rolling --quick", "fleet-rolling", {}),
    ("fleet --into vllm --json", "fleet-vllm", {}),
]


@pytest.mark.parametrize(("line", "name", "options"), DOCUMENTED)
def test_documented_command_lines_run_their_scenario(line, name, options):
    scenario, values = _selected(*line.split())
    assert scenario.name == name
    assert registry.run_arguments(scenario, values) == {"quick": "--quick" in line, **options}


def test_main_prints_the_json_result_or_its_ratios(monkeypatch, capsys):
    result = {"raw": {"seconds": 1.5}, "ratios": {"a_vs_b": 2.0, "c_vs_d": 0.5}}
    seen = []

    def fake_run(scenario, values):
        seen.append((scenario.name, values["quick"]))
        return result

    monkeypatch.setattr(registry, "run", fake_run)
    assert main(["bench", "generate", "--quick", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == result
    assert main(["bench", "sync", "--into", "vllm"]) == 0
    assert capsys.readouterr().out == "a_vs_b: 2.00x\nc_vs_d: 0.50x\n"
    assert seen == [("generate", True), ("sync-vllm", False)]


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("sync --lora", ["tandem bench generate --lora", "tandem bench sync --into vllm"]),
        ("sync --into vllm --engine-dtypes", ["tandem bench sync --engine-dtypes"]),
        ("generate --lora --model-family qwen3_moe", ["tandem bench generate --lora"]),
        ("serve --into vllm", ["tandem bench sync --into vllm", "tandem bench serve"]),
        ("fleet --rolling --tp 2", ["tandem bench fleet --rolling", "tandem bench serve"]),
        ("generate --lora --no-vllm", ["tandem bench generate --lora", "tandem bench generate"]),
    ],
)
def test_a_combination_no_scenario_has_names_the_choices(line, named, capsys):
    with pytest.raises(ValueError) as raised:
        _selected(*line.split())
    for choice in named:
        assert f"`{choice}`" in str(raised.value)
    assert main(["bench", *line.split()]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named[0] in err


def test_an_unknown_command_names_the_commands(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "train"])
    err = capsys.readouterr().err
    assert all(command in err for command in registry.commands())
    with pytest.raises(KeyError, match="sync-vllm"):
        registry.get("sync-nccl")
    with pytest.raises(ValueError, match="fleet"):
        registry.select("train", {})


def test_register_refuses_a_clash():
    sync = registry.get("sync")
    with pytest.raises(ValueError, match="already called"):
        registry.register(sync)
    twin = registry.Scenario("sync-twin", "sync", {"--into": "vllm"}, "the same line", sync.run)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(twin)
    odd = registry.Scenario(
        "sync-tp",
        "sync",
        {"--rolling": True},
        "--tp spelled anew",
        sync.run,
        options=(registry.option("--tp", type=float, default=2.0),),
    )
    with pytest.raises(ValueError, match="--tp"):
        registry.register(odd)
    first = registry.Scenario("train-rolling", "train", {"--rolling": True}, "no default", sync.run)
    with pytest.raises(ValueError, match="default"):
        registry.register(first)
    assert registry.scenarios("sync")[-1].name == "sync-delta"  # nothing half-registered
    assert "train" not in registry.commands()


def test_list_and_help_show_every_scenario(capsys):
    assert main(["bench", "list"]) == 0
    listed = capsys.readouterr().out
    assert main(["bench", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in rows] == [s.name for s in registry.scenarios()]
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "--help"])
    helped = capsys.readouterr().out
    for s in registry.scenarios():
        assert (
            f"{registry.command_line(s)}\n" in listed and f"{registry.command_line(s)}\n" in helped
        )


def test_the_cli_imports_no_bench_and_no_periphery():
    code = (
        "import sys; from tandem.cli import parser; parser(); "
        "loaded = sorted(m for m in sys.modules if m.startswith(('tandem.bench.', 'tandem.rl', "
        "'tandem.scale'))); print(loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['tandem.bench.registry']"

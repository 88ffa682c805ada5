"""The core (models, layers, kernels, engine, exchange, fleet, server, router, wire, lora and
the top-level modules) imports nothing from the periphery (benchmarks, the RL loop, the
integrations, the sync predictor, the command line), not even lazily inside a function; and
``import tandem`` loads no integration and no other project's framework."""

from __future__ import annotations

import ast
import subprocess
import sys

from support.paths import SRC

PERIPHERY = ("bench", "rl", "integrations", "scale", "cli")
FRAMEWORKS = ("vllm", "verl", "trl", "ray", "megatron", "peft", "lm_eval", "mooncake")


def _core_files() -> list:
    return [
        path
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).parts[0].removesuffix(".py") not in PERIPHERY
    ]


def _periphery_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a periphery module in ``source``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tandem" and len(parts) > 1 and parts[1] in PERIPHERY:
                found.append((node.lineno, name))
                break
    return found


def test_the_check_finds_a_periphery_import_at_any_depth():
    source = "import os\ndef f():\n    from tandem import bench\n    import tandem.rl.loop\n"
    assert _periphery_imports(source) == [(3, "tandem.bench"), (4, "tandem.rl.loop")]
    assert _periphery_imports("from tandem.engine import engine\nimport tandem\n") == []


def test_the_core_imports_nothing_from_the_periphery():
    files = _core_files()
    assert any(p.name == "fleet.py" for p in files) and len(files) > 100
    found = [
        f"{path.relative_to(SRC)}:{line}: {name}"
        for path in files
        for line, name in _periphery_imports(path.read_text())
    ]
    assert found == []


def test_importing_tandem_loads_no_integration_and_no_framework():
    code = (
        "import sys, tandem, tandem.llm, tandem.exchange, tandem.fleet.fleet, "
        "tandem.server.app, tandem.router.app\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = out.stdout.split()
    assert "tandem.fleet.fleet" in loaded  # the check sees what was imported
    periphery = [m for m in loaded if m.startswith(tuple(f"tandem.{p}" for p in PERIPHERY))]
    assert periphery == []
    assert sorted({m.split(".")[0] for m in loaded} & set(FRAMEWORKS)) == []

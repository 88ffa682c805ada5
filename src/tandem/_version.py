"""tandem's version: the installed distribution's (``tandem-rl``), else, run from a source tree
that is not installed, the one its ``pyproject.toml`` declares."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "tandem-rl"
UNKNOWN = "0+unknown"


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, ValueError, KeyError):
        return UNKNOWN
    if project.get("name") != DISTRIBUTION:
        return UNKNOWN
    return str(project.get("version", UNKNOWN))

"""Where things are: the repository, its sources, the scripts tests start."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # the scripts (trainers) live here
TESTS = SUPPORT.parent
REPO = TESTS.parent
SRC = REPO / "src" / "tandem"

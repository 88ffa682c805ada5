"""Where things are: the repository, its sources, the scripts tests start."""

import tempfile
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # the scripts (trainers) live here
TESTS = SUPPORT.parent
REPO = TESTS.parent
SRC = REPO / "src" / "tandem"


def rendezvous() -> str:
    """A fresh c10d rendezvous for a test's trainer ranks: a file in a new private folder (a
    TCP port found free can be taken by another process before the first rank binds it)."""
    return f"file://{tempfile.mkdtemp(prefix='tandem-test-rdzv-')}/store"

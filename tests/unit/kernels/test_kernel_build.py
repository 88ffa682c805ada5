"""tandem.kernels.build: a kernel is rebuilt when its source or a header beside it changes."""

import ctypes
from pathlib import Path

import pytest

from tandem.kernels import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler here")


def test_a_changed_header_rebuilds_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "value.h").write_text("#define VALUE 3\n")
    (src / "k.c").write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    first = build.build(src / "k.c")
    first.value.restype = ctypes.c_int
    assert first.value() == 3
    (src / "value.h").write_text("#define VALUE 4\n")
    second = build.build(src / "k.c")
    second.value.restype = ctypes.c_int
    assert second.value() == 4
    assert len(list(Path(tmp_path / "cache").glob("k-*.so"))) == 2

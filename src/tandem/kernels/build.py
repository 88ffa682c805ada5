"""Compile one of tandem's C kernel sources at first use and load it (`tandem.kernels.paged`,
`tandem.kernels.pointwise`).

Each source ships with the package and is compiled with the machine's C compiler
(``$CC``, ``cc`` or ``gcc``; ``-O3 -march=native -ffast-math -fopenmp``) into a cache keyed by
the source, the flags and the CPU's feature flags (``TANDEM_KERNEL_CACHE``, default
~/.cache/tandem/kernels), so a VM with other CPU features builds its own copy. The library
links the ``libgomp.so.1`` torch already loaded, so kernels and torch share one OpenMP pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# -ffast-math compiles only: linked with it, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads (subnormals would vanish in torch
# and Python too). The link step below leaves it out.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK = ("-shared", "-fopenmp")


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build(source: Path) -> ctypes.CDLL:
    """Compile (or reuse) ``source`` as a shared library; raises RuntimeError saying why not."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join((cc, *FLAGS, *LINK, cpu_flags())).encode()).hexdigest()
    cache = Path(os.environ.get("TANDEM_KERNEL_CACHE", Path.home() / ".cache/tandem/kernels"))
    lib = cache / f"{source.stem}-{key[:16]}.so"
    if not lib.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            obj, out = Path(tmp) / f"{source.stem}.o", Path(tmp) / lib.name
            for step in (
                [cc, *FLAGS, "-c", str(source), "-o", str(obj)],
                [cc, *LINK, str(obj), "-o", str(out), "-lm"],
            ):
                done = subprocess.run(step, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
            os.replace(out, lib)  # atomic: processes building at once each land a whole file
    return ctypes.CDLL(str(lib))

"""Compile one of tandem's C kernel sources at first use and load it (`tandem.kernels.paged`,
`tandem.kernels.pointwise`).

Each source ships with the package and is compiled with the machine's C compiler
(``$CC``, ``cc`` or ``gcc``; ``-O3 -march=native -ffast-math -fopenmp``) into a cache keyed by
the source, the headers beside it (``bf16.h``), the flags and the CPU's feature flags
(``TANDEM_KERNEL_CACHE``, default ~/.cache/tandem/kernels), so a VM with other CPU features
builds its own copy. The library links the ``libgomp.so.1`` torch already loaded, so kernels
and torch share one OpenMP pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# -ffast-math compiles only: linked with it, gcc adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads (subnormals would vanish in torch
# and Python too). The link step below leaves it out. 512-bit vectors where the CPU has them
# (gcc prefers 256 on AVX-512 CPUs): the decode kernel ran 1.2x faster with them.
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffast-math",
    "-fopenmp",
    "-fPIC",
    "-std=c11",
)
LINK = ("-shared", "-fopenmp")


def cpu_flags() -> str:
    """The CPU's feature line from /proc/cpuinfo (x86 ``flags``, Arm ``Features``), else the
    machine's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


@functools.cache
def cpu_features() -> frozenset[str]:
    """The features the CPU declares (``avx512_bf16``, ``amx_bf16``, Arm's ``bf16``, ...)."""
    line = cpu_flags()
    return frozenset(line.partition(":")[2].split()) if ":" in line else frozenset()


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
    for header in sorted(source.parent.glob("*.h")):  # what the sources include
        text += header.read_bytes()
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


class Library:
    """One kernel source, built on first need: ``available()`` says whether it serves this
    process, ``dll`` is the loaded library once it does. ``setup`` declares the C signatures;
    ``off`` is the environment variable whose value ``torch`` turns the kernels off; ``instead``
    names what serves when they do not (logged as a warning, or at debug level where the CPU
    lacks the feature ``needs`` names: nothing is wrong then)."""

    def __init__(
        self,
        source: Path,
        setup: Callable[[ctypes.CDLL], None],
        off: str,
        what: str,
        instead: str = "torch",
        needs: str | None = None,
    ):
        self.source, self.setup, self.off, self.what = source, setup, off, what
        self.instead, self.needs = instead, needs
        self.dll: ctypes.CDLL | None = None
        self.why_not: str | None = None

    def available(self) -> bool:
        """Whether the kernels serve (built on the first call; the reason logged if not)."""
        if self.dll is None and self.why_not is None:
            if os.environ.get(self.off, "") == "torch":
                self.why_not = f"{self.off}=torch"
            elif self.needs is not None and self.needs not in cpu_features():
                self.why_not = f"the CPU declares no {self.needs}"
                logger.debug("%s off, %s serves: %s", self.what, self.instead, self.why_not)
                return False
            else:
                try:
                    dll = build(self.source)
                    self.setup(dll)
                    self.dll = dll
                except (RuntimeError, OSError, AttributeError) as exc:
                    self.why_not = str(exc)
            if self.why_not is not None:
                logger.warning("%s off, %s serves: %s", self.what, self.instead, self.why_not)
        return self.dll is not None

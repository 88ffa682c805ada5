"""How a CPU engine's process takes host memory for its step tensors.

Every step allocates and frees the same activations (a prefill chunk's [2048, 2560] gate/up
output is 10 MB in bfloat16). glibc's malloc serves blocks of that size with fresh ``mmap``
regions, or trims them off its heap when freed, so the next step's writes fault every page
in again: ~70,000 faults per run of the bench's mixed workload, 4-5% of its time. vLLM's CPU
docs ask for tcmalloc (``LD_PRELOAD``) for this reason. tandem asks glibc, in the process that
holds a model runner, to keep blocks up to 32 MiB (``M_MMAP_THRESHOLD``'s ceiling on 64-bit)
on its heap and not to trim freed memory (``mallopt``); blocks larger than that (the KV
cache, checkpoints) still map and unmap. `release_freed` hands what the heap keeps back to
the OS (``malloc_trim``), which the engine does when it sleeps: the memory a sleep frees
leaves the process as before. Elsewhere than glibc (musl, macOS) nothing changes.
``EngineConfig.host_memory_reuse=False`` leaves the allocator as the process had it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts
TRIM_NEVER = 2**31 - 1  # mallopt takes an int: "trim when more than 2 GiB is free at the top"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed() -> bool:
    """Make this process's malloc keep freed step-sized blocks for reuse; whether it could."""
    libc = _glibc()
    if libc is None:
        log.info("host memory: not glibc, malloc left as it is")
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) == 1 and ok
    if not ok:
        log.warning("host memory: glibc refused mallopt; freed blocks go back to the OS")
    return ok


def release_freed() -> None:
    """Return the memory malloc keeps free to the OS (after a sleep released its tensors)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)

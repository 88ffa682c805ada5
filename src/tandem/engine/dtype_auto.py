"""What ``dtype="auto"`` runs in: resolved once, in the engine process, before any rank is
built, so every rank (worker processes, Ray actors, other nodes) is handed the concrete name.
The choice follows from the configuration, the checkpoint and the CPU's declared features,
never from a timing: the same command on the same machine always picks the same dtype.

- an explicit dtype is kept as given;
- ``TANDEM_AUTO_DTYPE=<name>`` in the environment resolves ``auto`` to that name (the test
  suite sets ``float32``);
- on a device other than the CPU, ``auto`` is ``bfloat16`` (as vLLM's ``auto`` casts a float32
  checkpoint to the device's half type);
- on the CPU, ``bfloat16`` where the CPU declares bfloat16 matmul units (`BF16_UNITS`: x86's
  ``amx_bf16`` or ``avx512_bf16``, Arm's ``bf16``), whatever the checkpoint's float dtype (as
  vLLM's CPU build casts a float32 checkpoint to bfloat16); else ``float32``, since bfloat16
  without those units is emulated, up to ~200x slower, and float32 holds a bfloat16 or float16
  checkpoint exactly.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Literal

from tandem.config import EngineConfig
from tandem.dtypes import DTYPES
from tandem.kernels.build import cpu_features
from tandem.models.loader import ModelSpec

AUTO_ENV = "TANDEM_AUTO_DTYPE"
BF16_UNITS = ("amx_bf16", "avx512_bf16", "bf16")  # /proc/cpuinfo names, strongest first

Source = Literal["configured", "environment", "device", "cpu"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype an engine runs in, and why."""

    dtype: str  # a name in `tandem.dtypes.DTYPES`
    source: Source
    reason: str


def checkpoint_dtype(spec: ModelSpec) -> str | None:
    """The float dtype the checkpoint's ``config.json`` declares (``dtype``, as transformers 5
    writes it, or ``torch_dtype``), or None where it declares none."""
    try:
        config = json.loads((spec.path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    declared = config.get("dtype") or config.get("torch_dtype")
    return declared if isinstance(declared, str) else None


def cpu_choice(checkpoint: str | None, features: frozenset[str]) -> DtypeChoice:
    """``auto`` on a CPU declaring ``features`` for a checkpoint stored in ``checkpoint``."""
    stored = f"a {checkpoint} checkpoint" if checkpoint else "a checkpoint of undeclared dtype"
    units = next((flag for flag in BF16_UNITS if flag in features), None)
    if units is not None:
        reason = f"auto on a CPU with bfloat16 units ({units}): bfloat16 for {stored}"
        return DtypeChoice("bfloat16", "cpu", reason)
    reason = (
        f"auto on a CPU without bfloat16 units (none of {', '.join(BF16_UNITS)}): "
        f"float32 for {stored}"
    )
    return DtypeChoice("float32", "cpu", reason)


def resolve_dtype(config: EngineConfig, spec: ModelSpec) -> DtypeChoice:
    """The concrete dtype ``config`` runs ``spec`` in, and why (an INFO line where ``auto``
    decided; a fleet's other replicas are handed the first one's name)."""
    choice = _resolve(config, spec)
    level = logging.DEBUG if choice.source == "configured" else logging.INFO
    log.log(level, "dtype %s (%s): %s", choice.dtype, choice.source, choice.reason)
    return choice


def _resolve(config: EngineConfig, spec: ModelSpec) -> DtypeChoice:
    if config.dtype != "auto":
        return DtypeChoice(config.dtype, "configured", f"dtype={config.dtype!r} was given")
    pinned = os.environ.get(AUTO_ENV)
    if pinned is not None:
        if pinned not in DTYPES:
            raise ValueError(f"{AUTO_ENV}={pinned!r}: must be one of {sorted(DTYPES)}")
        return DtypeChoice(pinned, "environment", f"{AUTO_ENV}={pinned}")
    if config.torch_device.type != "cpu":
        device = config.torch_device.type
        return DtypeChoice(
            "bfloat16",
            "device",
            f"auto on {device}: bfloat16 (as vLLM's auto for a float32 checkpoint)",
        )
    return cpu_choice(checkpoint_dtype(spec), cpu_features())

"""The RL demo's settings (`DemoConfig`), checked when made: every field a bad value names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.rl.grpo import CORRECTIONS

ENGINE_DTYPES = ("float32", "bfloat16", "fp8")
DELTAS = {"auto": "auto", "on": True, "off": False}  # how the trainers push: `delta=` of push


@dataclass
class DemoConfig:
    model_dir: str = ".tandem/tiny-llama"
    out_dir: str = ".tandem/demo"
    steps: int = 150
    prompts_per_step: int = 64
    group_size: int = 8
    digits: int = 3  # the task's string length; completions get digits + 1 tokens
    warmup_steps: int = 10  # supervised steps before RL (0: none)
    warmup_batch: int = 32
    eval_every: int = 25  # RL steps between eval points (the last step always has one)
    temperature: float = 1.0
    lr: float = 5e-3  # AdamW's rate in the warm-up and at the first RL step
    lr_end: float = 2.5e-3  # RL's rate decays linearly to this at the last step
    placement: Literal["colocate", "disaggregated"] = "colocate"
    async_staleness: int | None = None  # None: synchronous RL
    trainer_ranks: int = 2
    engine_tp: int = 2
    seed: int = 0
    engine_dtype: str = "float32"  # "float32" | "bfloat16" | "fp8" (bfloat16 + FP8 weights)
    is_correction: str = "none"  # "none" | "tis" | "mis": see `tandem.rl.grpo.correct_mismatch`
    is_cap: float = 2.0  # the importance weight's cap C (TIS truncates at it, MIS masks above)
    delta: str = "auto"  # "auto" | "on" | "off": the trainers' pushes (tandem.exchange.delta)

    def __post_init__(self) -> None:
        minimums = {
            "steps": 1,
            "prompts_per_step": self.trainer_ranks,
            "group_size": 2,
            "digits": 1,
            "warmup_steps": 0,
            "warmup_batch": self.trainer_ranks,
            "eval_every": 1,
            "trainer_ranks": 1,
            "engine_tp": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.digits > 4:
            raise ValueError(f"digits must be at most 4 (10**digits problems), got {self.digits}")
        for name in ("lr", "lr_end", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.placement not in ("colocate", "disaggregated"):
            raise ValueError(
                f"placement must be 'colocate' or 'disaggregated', got {self.placement!r}"
            )
        if self.async_staleness is not None and self.async_staleness < 1:
            raise ValueError(f"async_staleness must be >= 1 or None, got {self.async_staleness}")
        if self.engine_dtype not in ENGINE_DTYPES:
            raise ValueError(
                f"engine_dtype must be one of {ENGINE_DTYPES}, got {self.engine_dtype!r}"
            )
        if self.is_correction not in CORRECTIONS:
            raise ValueError(
                f"is_correction must be one of {CORRECTIONS}, got {self.is_correction!r}"
            )
        if self.delta not in DELTAS:
            raise ValueError(f"delta must be one of {sorted(DELTAS)}, got {self.delta!r}")
        if not (isinstance(self.is_cap, int | float) and self.is_cap >= 1):
            raise ValueError(f"is_cap must be a number >= 1, got {self.is_cap!r}")

    def rl_lr(self, step: int) -> float:
        return self.lr + (self.lr_end - self.lr) * step / max(1, self.steps - 1)

    @property
    def transport(self) -> str:
        return "shm" if self.placement == "colocate" else "dist"

    def engine_options(self) -> dict:
        """`LLM` options for ``engine_dtype``: FP8 is bfloat16 activations over block-FP8
        weights (the trainers' pushes are quantized on the way in)."""
        if self.engine_dtype == "fp8":
            return {"dtype": "bfloat16", "quantization": "fp8"}
        return {"dtype": self.engine_dtype}

"""Typed engine configuration; every check names the field to change."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.dtypes import DTYPES

ENCODE_KV_CACHE_BYTES = 4 << 20


class EngineConfig(BaseModel):
    """Options of `LLM` (and later `tandem serve`). Unknown options are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    task: Literal["generate", "embed", "classify"] = Field(
        "generate",
        description="generate: sampling (LLM.generate); embed: pooled hidden states "
        "(LLM.embed); classify: a classification or reward head's logits (LLM.classify)",
    )
    model_modules: list[str] = Field(
        default_factory=list,
        description="modules to import first: they register custom architectures",
    )
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    seed: int = Field(0, ge=0)
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens per step (decodes first, then prompt chunks); default 2048"
    )
    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = Field(
        True,
        description="reuse the KV blocks of a cached prompt prefix across requests, and prefill "
        "a request's n samples once (they share the prompt's blocks)",
    )
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_wait_s: float = Field(
        30.0, gt=0, description="a request waiting longer is admitted before younger ones"
    )
    batching: Literal["continuous", "static"] = Field(
        "continuous", description="static: admit a new batch only when the last one finished"
    )
    static_batch_window_s: float = Field(
        0.05,
        ge=0,
        description="static batching in a server: an idle engine lets a burst gather this long "
        "(or until max_num_seqs are queued) before starting a batch",
    )
    pipeline_layer_split: list[int] | None = Field(
        None, description="decoder layers per pipeline stage (uneven allowed); default: even"
    )
    nnodes: int = Field(1, ge=1, description="hosts the TP x PP ranks are spread over")
    master_addr: str = Field("127.0.0.1", description="this (the engine's) host, for workers")
    master_port: int | None = Field(
        None, ge=1, le=65535, description="c10d rendezvous port (multi-node); default: any free"
    )
    exchange_host: str = Field(
        "127.0.0.1", description="address the weight-exchange server listens on (trainers dial it)"
    )
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp", description="mp: worker processes on this host (and nodes that join); ray: each "
        "rank a Ray actor in one placement group",
    )  # fmt: skip
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="ray: how the placement group spreads the ranks over nodes"
    )
    ray_address: str | None = Field(
        None, description="ray: the cluster to join when not connected yet (default 'auto')"
    )
    ray_cpus_per_rank: float = Field(1.0, gt=0, description="ray: CPUs in each rank's bundle")
    worker_start_timeout_s: float = Field(300.0, gt=0)
    collective_timeout_s: float = Field(120.0, gt=0)
    kv_cache_memory: int | float = Field(
        1 << 30, description="bytes (int) or a fraction (0, 1] of free device memory (float)"
    )

    @model_validator(mode="before")
    @classmethod
    def _encode_budget(cls, values):
        """embed / classify engines keep no KV cache: a small default budget."""
        if isinstance(values, dict) and values.get("task", "generate") != "generate":
            values = {"kv_cache_memory": ENCODE_KV_CACHE_BYTES, **values}
        return values

    @field_validator("kv_cache_memory")
    @classmethod
    def _budget(cls, v):
        if isinstance(v, bool) or v <= 0 or (isinstance(v, float) and v > 1):
            raise ValueError("must be a byte count > 0 or a fraction in (0, 1]")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        try:
            torch.device(v)
        except RuntimeError:
            raise ValueError(f"not a torch device: {v!r}") from None
        return v

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

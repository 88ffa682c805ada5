"""Typed engine configuration, grouped by the component that reads it; every check names the
field to change.

`EngineConfig` holds what defines the model being served (model, task, dtype, device, seed,
context length) and one group per component: `SchedulerConfig`, `CacheConfig`,
`ParallelConfig` (the degrees and where the ranks run; its `dims` does the rank arithmetic)
and `RayConfig`. Users write the options flat, by vLLM's names (``LLM(model,
tensor_parallel_size=2, max_num_seqs=64)``, ``tandem serve`` flags, the TOML ``[engine]``
table): each flat name belongs to exactly one group and is moved there; an unknown name is an
error naming it. The nested form (``parallel={"tensor_parallel_size": 2}``) is taken too.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.dtypes import DTYPES
from tandem.models.base import Task
from tandem.parallel import ParallelDims

ENCODE_KV_CACHE_BYTES = 4 << 20


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulerConfig(_Group):
    """What each step takes (`tandem.engine.scheduler`)."""

    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens per step (decodes first, then prompt chunks); default 2048"
    )
    scheduling_policy: Literal["fcfs", "priority", "lof"] = Field(
        "fcfs",
        description="admission order after the preempted and the starving: arrival (fcfs), "
        "priority then arrival, or the longest output still to come first (lof: throughput "
        "under a backlog)",
    )
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


class CacheConfig(_Group):
    """The paged KV cache (`tandem.engine.kv_cache`)."""

    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = Field(
        True,
        description="reuse the KV blocks of a cached prompt prefix across requests, and prefill "
        "a request's n samples once (they share the prompt's blocks)",
    )
    kv_cache_memory: int | float = Field(
        1 << 30, description="bytes (int) or a fraction (0, 1] of free device memory (float)"
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _budget(cls, v):
        if isinstance(v, bool) or v <= 0 or (isinstance(v, float) and v > 1):
            raise ValueError("must be a byte count > 0 or a fraction in (0, 1]")
        return v


class ParallelConfig(_Group):
    """The parallel degrees and where the ranks run (executors, workers)."""

    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="independent replicas (each tensor x pipeline ranks of its own) "
        "behind one front (`tandem.fleet`): requests are routed over them, one push updates all",
    )
    pipeline_parallel_size: int = Field(1, ge=1)
    pipeline_layer_split: list[int] | None = Field(
        None, description="decoder layers per pipeline stage (uneven allowed); default: even"
    )
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="mp: worker processes on this host (and nodes that join); ray: each "
        "rank a Ray actor in one placement group",
    )
    nnodes: int = Field(1, ge=1, description="hosts the TP x PP ranks are spread over")
    master_addr: str = Field("127.0.0.1", description="this (the engine's) host, for workers")
    master_port: int | None = Field(
        None, ge=1, le=65535, description="c10d rendezvous port (multi-node); default: any free"
    )
    worker_start: Literal["auto", "fork", "exec"] = Field(
        "auto",
        description="fork: each worker forked from a template process that imported torch "
        "and tandem once (Linux; about 2 s of CPU less per worker); exec: each worker a "
        "fresh interpreter; auto: fork on CPU, exec on an accelerator (no CUDA state is "
        "ever inherited through a fork)",
    )
    worker_start_timeout_s: float = Field(300.0, gt=0)
    collective_timeout_s: float = Field(
        120.0,
        gt=0,
        description="the ranks' torch.distributed collectives, and how long the "
        "engine waits for a step's result before it declares a rank hung (killed: a fleet "
        "quarantines the replica and runs its requests again elsewhere)",
    )
    push_phase_timeout_s: float = Field(
        300.0,
        gt=0,
        description="how long a weight push's transport waits (trainers staging, "
        "joining the dist group, each transfer) before it fails the push; a rank still silent "
        "min(30 s, this) later is declared hung and killed (a fleet quarantines its replica and "
        "goes on)",
    )

    @property
    def hung_after_s(self) -> float:
        """When a rank silent in a push phase is declared hung: past the transport's own
        waits (`push_phase_timeout_s`), by a margin."""
        return self.push_phase_timeout_s + min(30.0, self.push_phase_timeout_s)

    @model_validator(mode="after")
    def _fleet(self):
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError(
                "nnodes > 1 spreads one replica over hosts; a fleet over hosts "
                "is `tandem router` over `tandem serve` instances, or "
                "distributed_executor_backend='ray' (set nnodes=1)"
            )
        return self

    @property
    def dims(self) -> ParallelDims:
        """The degrees and the rank arithmetic (rank = pp_rank * tp + tp_rank)."""
        return ParallelDims(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.dims.world_size


class FleetConfig(_Group):
    """A fleet's own settings (``data_parallel_size`` > 1, `tandem.fleet`); its deadlines
    follow ``push_phase_timeout_s``, which every engine's pushes share."""

    max_staleness: int | None = Field(
        None,
        ge=0,
        description="fleet: how many versions behind the newest a replica may be "
        "and still take new requests during a rolling push (0: only the newest; requests "
        "wait for the first wave); None: any",
    )
    heal: bool = Field(
        True,
        description="fleet: a quarantined replica (restarted if its workers are gone) "
        "pulls the weights from a live peer replica, then serves again",
    )


class RayConfig(_Group):
    """``distributed_executor_backend="ray"``: the placement group of rank actors."""

    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="ray: how the placement group spreads the ranks over nodes"
    )
    ray_address: str | None = Field(
        None, description="ray: the cluster to join when not connected yet (default 'auto')"
    )
    ray_cpus_per_rank: float = Field(1.0, gt=0, description="ray: CPUs in each rank's bundle")


class LoRAConfig(_Group):
    """LoRA adapters (`tandem.layers.lora`), by vLLM's option names."""

    enable_lora: bool = Field(
        False,
        description="serve LoRA adapters: requests name one (LoRARequest, a completion's "
        "`model`); trainers push them (WeightSender with lora_name)",
    )
    max_loras: int = Field(
        1, ge=1, description="adapter slots on every rank: adapters (versions) loaded at once"
    )
    max_lora_rank: int = Field(16, ge=1, description="the highest adapter rank (PEFT r) served")


GROUPS: dict[str, type[_Group]] = {
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "parallel": ParallelConfig,
    "fleet": FleetConfig,
    "ray": RayConfig,
    "lora": LoRAConfig,
}
_GROUP_OF = {name: group for group, cls in GROUPS.items() for name in cls.model_fields}


class EngineConfig(BaseModel):
    """Options of `LLM` and `tandem serve`, flat by vLLM's names or nested by group. Unknown
    options are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    task: Task = Field(
        "generate",
        description="generate: sampling (LLM.generate); embed: pooled hidden states "
        "(LLM.embed); classify: a classification or reward head's logits (LLM.classify)",
    )
    model_modules: list[str] = Field(
        default_factory=list,
        description="modules to import first: they register custom architectures",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: bfloat16 on GPUs and on CPUs that declare bfloat16 units "
        "(amx_bf16, avx512_bf16, Arm bf16), else float32 (`tandem.engine.dtype_auto`)",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: hold the linear layers' weights as block-FP8 (e4m3 + one float32 "
        "scale per 128 x 128 block), quantizing a float checkpoint as it loads; an HF FP8 "
        "checkpoint (quantization_config quant_method 'fp8') is served so without it. "
        "Matmuls run in `dtype` on the dequantized weight (`tandem.layers.fp8`)",
    )
    device: str = "cpu"
    packed_weights: bool = Field(
        True,
        description="CPU, float32: keep each matmul weight a second time in oneDNN's blocked "
        "layout (2x the weights' memory) for faster matmuls; remade after every write into the "
        "live weights (`tandem.layers.gemm`)",
    )
    paged_kernels: bool = Field(
        True,
        description="attention reads the paged KV cache in place with tandem's kernels "
        "(decode: `tandem.kernels.paged`; causal prompt chunks: `tandem.kernels.paged_prefill`) "
        "where they support the dtype, device and head shape; false: K and V are gathered into "
        "contiguous tensors for torch's attention (the reference path, slower)",
    )
    host_memory_reuse: bool = Field(
        True,
        description="CPU: glibc's malloc keeps freed blocks up to 32 MiB for the next step "
        "instead of returning them to the OS, so step tensors do not fault their pages in "
        "again; a sleep returns them (`tandem.engine.host_memory`)",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="auto: read the weights from the checkpoint; dummy: read nothing (zeros), "
        "and refuse requests until a push lands (a fleet's replica that joins from a peer)",
    )
    seed: int = Field(0, ge=0)
    max_model_len: int | None = Field(None, ge=2)
    exchange_host: str = Field(
        "127.0.0.1", description="address the weight-exchange server listens on (trainers dial it)"
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @model_validator(mode="before")
    @classmethod
    def _group_flat_options(cls, values: Any):
        """Flat options into their groups; embed / classify engines keep no KV cache, so a
        small default budget."""
        if not isinstance(values, dict):
            return values
        values = dict(values)
        for name in [n for n in values if n in _GROUP_OF]:
            group = _GROUP_OF[name]
            nested = values.get(group, {})
            if isinstance(nested, BaseModel):
                nested = nested.model_dump(exclude_unset=True)
            if not isinstance(nested, dict):
                break  # the group's own validation names the problem
            if name in nested:
                raise ValueError(f"{name} is given both flat and in {group}")
            values[group] = {**nested, name: values.pop(name)}
        cache = values.get("cache", {})
        if values.get("task", "generate") != "generate" and isinstance(cache, dict):
            values["cache"] = {"kv_cache_memory": ENCODE_KV_CACHE_BYTES, **cache}
        return values

    @model_validator(mode="after")
    def _lora_fits(self):
        if self.lora.enable_lora and self.task != "generate":
            raise ValueError(f"enable_lora serves generation; task is {self.task!r}")
        if self.lora.enable_lora and self.parallel.data_parallel_size > 1:
            raise ValueError("enable_lora with data_parallel_size > 1 is not supported yet")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        try:
            torch.device(v)
        except RuntimeError:
            raise ValueError(f"not a torch device: {v!r}") from None
        return v

    def flat(self) -> dict[str, Any]:
        """Every option by its flat (vLLM) name."""
        out = self.model_dump(exclude=set(GROUPS))
        for group in GROUPS:
            out.update(getattr(self, group).model_dump())
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' has no torch dtype until the engine resolves it")
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def flat_location(loc: tuple) -> tuple:
    """A validation error's location as the user wrote it: ``("parallel", "nnodes")`` ->
    ``("nnodes",)`` (flat names are unique across groups)."""
    if len(loc) >= 2 and loc[0] in GROUPS and _GROUP_OF.get(loc[1]) == loc[0]:
        return loc[1:]
    return loc

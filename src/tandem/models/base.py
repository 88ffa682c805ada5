"""The model contract: what the engine needs from a model class, and what it can do.

Capabilities are class attributes declared here once with their defaults; each model class
declares what differs, and the engine reads them as attributes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal, get_args

import torch
from pydantic import BaseModel
from torch import nn

from tandem.models.labels import Labels
from tandem.models.stages import PipelineLayout

Task = Literal["generate", "embed", "classify"]
Pooling = Literal["cls", "last", "mean"]


class TandemModel(nn.Module, ABC):
    """Base of every registered model class (an ``nn.Module`` built from ``tandem.layers``).

    ``__init__(config, tp)`` builds the layers for tensor-parallel rank ``tp`` (a `TPGroup`).
    Decoder layers are called as ``layer(hidden, context, meta)``; the engine runs the layers of
    its pipeline stage between ``embed`` (first stage) and ``final_norm`` (last stage). A class
    whose ``tasks`` hold ``"generate"`` provides ``compute_logits(hidden)`` (full-vocabulary
    logits); one whose ``tasks`` hold ``"classify"`` provides ``classify(pooled)`` (the head's
    logits) and parses config.json with a `Labels` subclass (``id2label``); one whose
    ``inputs`` are ``"pixels"`` provides ``image_shape(config)``.
    """

    config_class: ClassVar[type[BaseModel]]  # parses config.json; num_layers, hidden_size, ...
    pipeline: ClassVar[PipelineLayout]

    tasks: ClassVar[frozenset[Task]] = frozenset({"embed"})  # the LLM(task=...) it serves
    inputs: ClassVar[Literal["tokens", "pixels"]] = "tokens"  # what embed() reads
    token_types: ClassVar[bool] = False  # embed() takes token_type_ids (BERT segments)
    default_pooling: ClassVar[Pooling] = "last"  # the row embed / classify pool by default
    optional_prefix: ClassVar[str | None] = None  # a checkpoint may omit it from tensor names
    # its decoder layers honour AttentionMetadata.keep: the engine runs the last layer past
    # attention on the rows it samples from only (a prompt's other rows are only keys/values)
    keeps_rows: ClassVar[bool] = False

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> object:
        """Per-step values every layer shares (e.g. rotary tables; ``None`` if none)."""

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def decode_layers(
        self, layers: list[nn.Module], hidden: torch.Tensor, context: object, meta: object
    ) -> torch.Tensor | None:
        """``layers``' output for ``hidden`` in one kernel call, where the model has one that
        serves this step (a few decode rows: `LlamaForCausalLM`); None: the engine calls each
        layer."""
        return None

    @staticmethod
    @abstractmethod
    def max_context_len(config: BaseModel) -> int:
        """The longest sequence the model computes exactly."""

    @staticmethod
    def unused_checkpoint_tensors(config: BaseModel) -> set[str]:
        """Checkpoint tensors to ignore rather than report as unexpected (a tied head, cached
        buffers)."""
        return set()

    @staticmethod
    def moe_layers(config: BaseModel) -> list[int]:
        """Decoder layers whose MLP routes tokens to experts (routing replay records them)."""
        return []


_TASK_METHODS: dict[Task, str] = {"generate": "compute_logits", "classify": "classify"}


def contract_problems(cls: type) -> list[str]:
    """What ``cls`` lacks or declares inconsistently as a `TandemModel` (empty: none)."""
    if not (isinstance(cls, type) and issubclass(cls, TandemModel)):
        return ["it does not subclass tandem.models.TandemModel"]
    missing = [name for name in ("config_class", "pipeline") if name not in dir(cls)]
    problems = [f"no {name}" for name in missing]
    if cls.__abstractmethods__:
        problems.append(f"does not implement {sorted(cls.__abstractmethods__)}")
    unknown = set(cls.tasks) - set(get_args(Task))
    if unknown:
        problems.append(f"tasks names unknown tasks {sorted(unknown)}")
    for task, method in _TASK_METHODS.items():
        has = callable(getattr(cls, method, None))
        if (task in cls.tasks) != has:
            problems.append(
                f"tasks {sorted(cls.tasks)} {'lack' if has else 'hold'} {task!r} but the class "
                f"{'defines' if has else 'has no'} {method}"
            )
    labelled = "config_class" in missing or issubclass(cls.config_class, Labels)
    if "classify" in cls.tasks and not labelled:
        problems.append("tasks hold 'classify' but config_class does not subclass Labels")
    if cls.inputs == "pixels" and not callable(getattr(cls, "image_shape", None)):
        problems.append("inputs = 'pixels' but no image_shape(config)")
    return problems

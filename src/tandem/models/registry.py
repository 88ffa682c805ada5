"""Architecture name -> model class. Each model file registers its own names."""

from __future__ import annotations

import importlib
from typing import Protocol

import torch
from pydantic import BaseModel
from torch import nn

from tandem.models.stages import PipelineLayout
from tandem.parallel import TPGroup


class CausalLM(Protocol):
    """What the engine needs from a model class (an ``nn.Module``).

    Decoder layers are called as ``layer(hidden, context, meta)``; the engine runs the layers of
    its pipeline stage between ``embed`` (first stage) and ``final_norm`` (last stage).
    """

    config_class: type[BaseModel]  # parses config.json; has num_layers, hidden_size, vocab_size
    pipeline: PipelineLayout

    def __init__(self, config: BaseModel, tp: TPGroup): ...

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> object:
        """Per-step values every layer shares (e.g. rotary tables)."""

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    def max_context_len(config: BaseModel) -> int: ...


_MODELS: dict[str, type[nn.Module]] = {}


def register_model(*architectures: str):
    """Class decorator: serve checkpoints whose ``config.json`` ``architectures`` names these."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for arch in architectures:
            if arch in _MODELS and _MODELS[arch] is not cls:
                raise ValueError(f"architecture {arch!r} already registered by {_MODELS[arch]}")
            _MODELS[arch] = cls
        return cls

    return wrap


def model_class(architecture: str) -> type[nn.Module] | None:
    return _MODELS.get(architecture)


def registered_architectures() -> list[str]:
    return sorted(_MODELS)


def import_model_modules(modules: list[str]) -> None:
    """Import the modules that register custom architectures (``model_modules`` option)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"model_modules: cannot import {name!r} ({exc})") from None

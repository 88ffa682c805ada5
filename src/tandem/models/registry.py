"""Architecture name -> model class. Each model file registers its own names."""

from __future__ import annotations

from typing import Protocol

import torch
from pydantic import BaseModel
from torch import nn

from tandem.layers.attention import AttentionMetadata
from tandem.parallel import TPGroup


class CausalLM(Protocol):
    """What the engine needs from a model class (an ``nn.Module``)."""

    config_class: type[BaseModel]

    def __init__(self, config: BaseModel, tp: TPGroup): ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Flat token batch -> final hidden states [T, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


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

"""Architecture name -> model class. Each model file registers its own names."""

from __future__ import annotations

import importlib

from tandem.models.base import TandemModel, contract_problems

_MODELS: dict[str, type[TandemModel]] = {}


def register_model(*architectures: str):
    """Class decorator: serve checkpoints whose ``config.json`` ``architectures`` names these.

    The class must subclass `TandemModel` and declare what it does; a ``TypeError`` naming the
    class lists what is missing or inconsistent."""

    def wrap(cls: type[TandemModel]) -> type[TandemModel]:
        problems = contract_problems(cls)
        if problems:
            name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
            raise TypeError(f"cannot register {name}: " + "; ".join(problems))
        for arch in architectures:
            if arch in _MODELS and _MODELS[arch] is not cls:
                raise ValueError(f"architecture {arch!r} already registered by {_MODELS[arch]}")
            _MODELS[arch] = cls
        return cls

    return wrap


def model_class(architecture: str) -> type[TandemModel] | None:
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

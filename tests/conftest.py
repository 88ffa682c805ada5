import os

import pytest
import torch

from tandem.models.tiny import make_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(family, **overrides) -> directory of a random-init model, built once per config."""
    made: dict[tuple, str] = {}

    def make(family: str = "llama", *, seed: int = 0, **overrides) -> str:
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-model")
            made[key] = str(make_tiny_model(path, family, seed=seed, overrides=overrides))
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> str:
    return model_factory("llama")

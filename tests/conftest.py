import os

# Ray (tests/integrations/ray) resolves 127.0.0.1 to this host's interface address unless told it
# is not running a real cluster: keep every local Ray cluster on loopback. Set before Ray is
# imported anywhere; subprocesses (Ray workers, `tandem serve`) inherit it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Engines built with the default dtype="auto" run float32 on every machine (no start-up probe):
# most tests compare with transformers in float32 at 1e-4, and bfloat16 is ~200x slower on
# CPUs without bfloat16 units. The bfloat16 tests ask for it by name; the probe's own tests
# clear this. Subprocesses (workers, `tandem serve`) inherit it.
os.environ.setdefault("TANDEM_AUTO_DTYPE", "float32")

import pytest  # noqa: E402
import torch

from tandem.models.tiny import make_tiny_model

# the cores shared among the test processes running at once (`make test` runs two, xdist)
_RUNNING = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _RUNNING)))


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

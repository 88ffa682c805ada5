"""tandem: serve the policy across processes, take the trainer's weights in place."""

from tandem._version import package_version
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import (
    LoRAError,
    LoRASlotsFull,
    ModelLoadError,
    StaleVersionError,
    UnsupportedModelError,
)
from tandem.llm import LLM
from tandem.lora.request import LoRARequest

__version__ = package_version()

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "LoRARequest",
    "LoRAError",
    "LoRASlotsFull",
    "RequestOutput",
    "CompletionOutput",
    "ModelLoadError",
    "UnsupportedModelError",
    "StaleVersionError",
]

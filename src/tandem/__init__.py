"""tandem: serve the policy across processes, take the trainer's weights in place."""

from tandem.engine.llm import LLM
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import LoRAError, LoRASlotsFull, ModelLoadError, UnsupportedModelError
from tandem.integrations import vllm as _vllm  # noqa: F401  (vLLM engines as push targets)
from tandem.lora.request import LoRARequest

__all__ = [
    "LLM",
    "SamplingParams",
    "LoRARequest",
    "LoRAError",
    "LoRASlotsFull",
    "RequestOutput",
    "CompletionOutput",
    "ModelLoadError",
    "UnsupportedModelError",
]

"""LoRA adapters: requests that name one, their PEFT configuration and tensors.

The engine side (slots on the parallel linear layers, rows of a batch each applying their own
adapter) is `tandem.layers.lora`; which adapter version sits in which slot is
`tandem.engine.lora_registry`; adapters travel into the slots as pushes (`WeightSender` with
``lora_name``), from a trainer's PEFT model, a PEFT directory or tensors in memory.
"""

from tandem.lora.config import LORA_MODULES, AdapterConfig
from tandem.lora.request import LoRARequest

__all__ = ["LORA_MODULES", "AdapterConfig", "LoRARequest"]

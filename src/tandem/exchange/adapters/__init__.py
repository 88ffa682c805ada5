"""Trainer-side layouts: what each rank of a trainer (or the engine) holds, as canonical boxes."""

from tandem.exchange.adapters.dtensor import dtensor_layout, shard_box
from tandem.exchange.adapters.engine import engine_layout
from tandem.exchange.adapters.hf import module_layout
from tandem.exchange.adapters.megatron import GPT_TO_LLAMA, MegatronLlamaConfig, megatron_layout

__all__ = [
    "GPT_TO_LLAMA",
    "MegatronLlamaConfig",
    "dtensor_layout",
    "engine_layout",
    "megatron_layout",
    "module_layout",
    "shard_box",
]

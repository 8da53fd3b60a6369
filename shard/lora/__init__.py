"""PEFT LoRA adapters of one rank: reading and validating adapter files, the resident device
slots (LRU swap-in) and their attachment to the model's linears (shard/layers/lora.py applies
them, shard/kernels/lora.py on CUDA)."""

from shard.layers.lora import LoraBatch
from shard.lora.adapter import (
    AdapterFacts,
    AdapterLoadError,
    AdapterSource,
    HostAdapter,
    parse_adapters_flag,
)
from shard.lora.manager import AdapterExistsError, LoraLimits, LoraManager, attach_lora

__all__ = [
    "AdapterExistsError",
    "AdapterFacts",
    "AdapterLoadError",
    "AdapterSource",
    "HostAdapter",
    "LoraBatch",
    "LoraLimits",
    "LoraManager",
    "attach_lora",
    "parse_adapters_flag",
]

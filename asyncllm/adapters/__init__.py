"""Multi-LoRA: PEFT adapters loaded per request, kept in a CPU LRU and in device slots."""

from .peft_loader import LoRAWeights, load_peft_adapter
from .registry import LoRARegistry
from .slots import LoRASlots

__all__ = ["LoRAWeights", "load_peft_adapter", "LoRARegistry", "LoRASlots"]

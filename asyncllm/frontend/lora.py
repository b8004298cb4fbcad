"""Resolving a request's ``lora=`` (an adapter name or a LoRARequest) to loaded weights."""

from __future__ import annotations

from typing import Any

from ..adapters.peft_loader import LoRAWeights
from ..adapters.registry import LoRARegistry
from ..errors import InvalidRequestError
from ..lora_request import LoRARequest


def lora_key(lora: Any) -> tuple[str, str | None] | None:
    """``(name, path or None)`` for a ``lora=`` argument; None for the base model."""
    if lora is None:
        return None
    if isinstance(lora, str):
        return lora, None
    if isinstance(lora, LoRARequest):
        return lora.name, str(lora.path)
    raise InvalidRequestError(f"lora: expected an adapter name or a LoRARequest, got {type(lora).__name__}",
                              field="lora")


def cached_lora(registry: LoRARegistry, lora: Any) -> LoRAWeights | None:
    """The adapter if it is already in memory (no disk access), else None."""
    key = lora_key(lora)
    return registry.cached(*key) if key else None


def load_lora(registry: LoRARegistry, lora: Any) -> LoRAWeights | None:
    """Resolve ``lora=``, reading the adapter from disk if needed (blocking: call off the hot path)."""
    key = lora_key(lora)
    return registry.load(*key) if key else None

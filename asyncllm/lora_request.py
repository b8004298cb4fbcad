"""``LoRARequest``: names a PEFT adapter for a request (the adapters themselves come in asyncllm.adapters)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    name: str
    path: str

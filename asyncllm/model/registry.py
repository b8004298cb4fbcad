"""The architectures this engine runs: Hugging Face architecture name -> how to build and fill it.

One entry per checkpoint layout. The loader reads ``fused`` to place each checkpoint tensor in the
engine's fused parameters (``qkv_proj``, ``gate_up_proj``), and the LoRA loader reads
``lora_targets`` for the PEFT modules an adapter may touch. The model class is named as a dotted
path and imported on use, so this module imports nothing heavy and anyone may import it.

Adding an architecture: an entry here, plus a model file when its layers differ from the Llama
family's (``model/phi3.py`` is the example of a family that needs only its config checked).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ModelLoadError

# Llama-family checkpoints keep q/k/v and gate/up apart; the engine fuses them.
SPLIT_PROJECTIONS: dict[str, tuple[str, Any]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Architecture:
    """How one checkpoint layout becomes the engine's model."""

    name: str                                   # the config's ``architectures`` entry
    model_class: str                            # "module:Class", imported on use
    fused: dict[str, tuple[str, Any]] = field(default_factory=dict)  # checkpoint module -> (fused, part)
    lora_targets: tuple[str, ...] = ()          # PEFT target modules adapters may use
    check_config: Callable[[Any], None] | None = None  # raises ModelLoadError for unsupported variants

    def build(self, *args, **kwargs):
        module_name, _, class_name = self.model_class.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        return cls(*args, **kwargs)


def _phi3_check(config) -> None:
    from .phi3 import check_phi3_config

    check_phi3_config(config)


_LLAMA_MODEL = "asyncllm.model.llama:LlamaFamilyModel"
ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch for arch in (
        Architecture("LlamaForCausalLM", _LLAMA_MODEL, SPLIT_PROJECTIONS, LLAMA_LORA_TARGETS),
        Architecture("MistralForCausalLM", _LLAMA_MODEL, SPLIT_PROJECTIONS, LLAMA_LORA_TARGETS),
        Architecture("Qwen2ForCausalLM", _LLAMA_MODEL, SPLIT_PROJECTIONS, LLAMA_LORA_TARGETS),
        Architecture("Qwen3ForCausalLM", _LLAMA_MODEL, SPLIT_PROJECTIONS, LLAMA_LORA_TARGETS),
        # Phi-3 checkpoints store qkv_proj and gate_up_proj fused already, in the engine's order
        Architecture("Phi3ForCausalLM", _LLAMA_MODEL, {}, (), _phi3_check),
    )
}


def supported_architectures() -> list[str]:
    return list(ARCHITECTURES)


# model_type -> architecture, for configs without ``architectures`` (GGUF conversions, hand-written configs)
MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def architecture_names(config) -> list[str]:
    """The config's ``architectures``, or the one its ``model_type`` implies when that list is missing."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in MODEL_TYPE_ARCHITECTURES:
        names = [MODEL_TYPE_ARCHITECTURES[config.model_type]]
    return names


def architecture_for(config) -> Architecture:
    """The entry of a transformers config; ModelLoadError naming the supported ones otherwise."""
    names = architecture_names(config)
    for name in names:
        arch = ARCHITECTURES.get(name)
        if arch is not None:
            if arch.check_config is not None:
                arch.check_config(config)
            return arch
    raise ModelLoadError(f"unsupported architecture {names or getattr(config, 'model_type', '?')}; "
                         f"supported: {', '.join(ARCHITECTURES)}")


def architecture_named(name: str) -> Architecture:
    """The entry for ``name`` (a DecoderShape's ``architecture``)."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}") from None

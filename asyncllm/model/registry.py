"""The architectures this engine runs: Hugging Face architecture name -> the model class that runs it.

Classes are named as dotted paths and imported on first use, so this module imports nothing heavy
and anyone may import it. What the loader, the tensor-parallel sharding, the LoRA loader and the
fast paths need to know about a family is declared on its class (``model/decoder.py``:
``packed_modules``, ``renamed``, ``lora_targets``, ``fast_paths``, ``gguf_architectures``); an
:class:`Architecture` hands that declaration out.

Architectures without a native class run through transformers' own modules with the engine's paged
attention plugged in (``model/transformers_backend.py``) when transformers implements them; the
choice is ``model_impl`` ("auto": native where there is a class, else transformers).

Adding a family: a model file with its class (``model/granite.py`` is a short example) and a line
in :data:`NATIVE` (and :data:`MODEL_TYPES` for configs that lack ``architectures``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..errors import ModelLoadError

# Llama-family checkpoints keep q/k/v and gate/up apart; the engine fuses them (model/decoder.py).
SPLIT_PROJECTIONS: dict[str, tuple[str, Any]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

NATIVE: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "llama:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "GemmaForCausalLM": "gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "GraniteForCausalLM": "granite:GraniteForCausalLM",
    "Olmo2ForCausalLM": "olmo2:Olmo2ForCausalLM",
    "SmolLM3ForCausalLM": "smollm3:SmolLM3ForCausalLM",
    "CohereForCausalLM": "cohere:CohereForCausalLM",
    "Glm4ForCausalLM": "glm4:Glm4ForCausalLM",
    # mixture-of-experts families (model/moe.py)
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "qwen_moe:Qwen3MoeForCausalLM",
    "GraniteMoeForCausalLM": "granitemoe:GraniteMoeForCausalLM",
    # multi-head latent attention over a latent KV cache (model/mla.py), with mixture-of-experts MLPs
    "DeepseekV2ForCausalLM": "deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "deepseek:DeepseekV3ForCausalLM",
    # attention sinks, alternating sliding/full layers, clamped-SwiGLU experts with biases (model/gpt_oss.py)
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
    # interleaved dense/MoE layers, NoPE and chunked-attention layers (model/llama4.py); the multimodal one text-only
    "Llama4ForCausalLM": "llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "llama4:Llama4ForConditionalGeneration",
    # vision-language models: images in, text out (model/llava.py, docs/multimodal.md)
    "LlavaForConditionalGeneration": "llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "llava:LlavaNextForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "gemma3_vl:Gemma3ForConditionalGeneration",
    # dynamic-resolution vision towers and M-RoPE positions (model/qwen2_vl.py)
    "Qwen2VLForConditionalGeneration": "qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl:Qwen2_5_VLForConditionalGeneration",
}
TRANSFORMERS_BACKEND = "transformers_backend:TransformersModel"

# model_type -> architecture, for configs without ``architectures`` (GGUF conversions, hand-written configs)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "granite": "GraniteForCausalLM",
               "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "cohere": "CohereForCausalLM",
               "glm4": "Glm4ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "gpt_oss": "GptOssForCausalLM",
               "llama4_text": "Llama4ForCausalLM", "llama4": "Llama4ForConditionalGeneration",
               "llava": "LlavaForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
               "llava_next": "LlavaNextForConditionalGeneration",
               "qwen2_vl": "Qwen2VLForConditionalGeneration",
               "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
MODEL_IMPLS = ("auto", "native", "transformers")


def _import(path: str):
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module_name}"), class_name)


@dataclass(frozen=True)
class Architecture:
    """One architecture and the class that runs it (imported on use)."""

    name: str           # the config's ``architectures`` entry
    class_path: str     # "module:Class" inside asyncllm.model

    def model_class(self):
        return _import(self.class_path)

    @property
    def native(self) -> bool:
        return self.class_path != TRANSFORMERS_BACKEND

    @property
    def fused(self) -> dict[str, tuple[str, Any]]:
        """Checkpoint module -> (the engine's fused module, the part it fills)."""
        return self.model_class().packed_modules

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return self.model_class().lora_targets

    def build(self, *args, **kwargs):
        return self.model_class()(*args, **kwargs)


def supported_architectures() -> list[str]:
    """The architectures with a native model class."""
    return list(NATIVE)


def architecture_names(config) -> list[str]:
    """The config's ``architectures``, or the one its ``model_type`` implies when that list is missing."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in MODEL_TYPES:
        names = [MODEL_TYPES[config.model_type]]
    return names


def architecture_for(config, model_impl: str = "auto") -> Architecture:
    """The architecture entry for a transformers config, its variant checked (ModelLoadError naming the
    unsupported feature and its config key, or the architectures there are)."""
    if model_impl not in MODEL_IMPLS:
        raise ModelLoadError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}; got {model_impl!r}")
    names = architecture_names(config)
    if model_impl != "transformers":
        for name in names:
            if name in NATIVE:
                arch = Architecture(name, NATIVE[name])
                arch.model_class().check_config(config)
                return arch
        if model_impl == "native":
            raise ModelLoadError(f"no native implementation of {names or getattr(config, 'model_type', '?')} "
                                 f"(model_impl='native'); native: {', '.join(NATIVE)}")
    arch = Architecture((names or [getattr(config, "model_type", "?")])[0], TRANSFORMERS_BACKEND)
    arch.model_class().check_config(config)
    return arch


def architecture_named(name: str) -> Architecture:
    """The entry for ``name`` (a DecoderShape's ``architecture``)."""
    if name in NATIVE:
        return Architecture(name, NATIVE[name])
    return Architecture(name, TRANSFORMERS_BACKEND)

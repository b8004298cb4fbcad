"""The Llama family: Llama 2/3 (with or without attention/MLP biases), Mistral, Qwen2/2.5 and Qwen3.

Each class is the shared decoder (``model/decoder.py``) with its own reading of the config; the
differences are small: Qwen2 always has q/k/v biases (and none on o_proj), Qwen3 norms q and k per
head, Mistral and Qwen2 may have sliding-window layers.
"""

from __future__ import annotations

from .decoder import DecoderModel
from .shape import DecoderShape


def layer_windows(config, num_layers: int) -> tuple:
    """Per layer, the sliding window of the config's ``sliding_window``/``layer_types`` (() when none)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return ()
    types = getattr(config, "layer_types", None)
    windows = (tuple(window if t == "sliding_attention" else None for t in types) if types
               else (int(window),) * num_layers)
    return windows if any(w is not None for w in windows) else ()


class LlamaForCausalLM(DecoderModel):
    gguf_architectures = ("llama",)
    gguf_permuted_qk = True

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.layer_windows = layer_windows(config, shape.num_layers)
        return shape


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_architectures = ("qwen2",)
    gguf_permuted_qk = False
    bias_on_o_proj = False

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.qkv_bias, shape.o_bias = True, False
        return shape


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_architectures = ("qwen3",)
    gguf_permuted_qk = False

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.qk_norm = "head"
        return shape


LlamaFamilyModel = LlamaForCausalLM  # the name this module's model had before the families split

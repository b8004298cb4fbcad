"""Gemma 3 (text): Gemma 2's decoder with q/k norms, and rope that differs by layer type.

Sliding-window layers rotate with their own base (``rope_parameters["sliding_attention"]``, or
``rope_local_base_freq`` in older configs) and global layers with the model's (possibly scaled)
rope. Soft-capping is off unless the config sets it.
"""

from __future__ import annotations

from .gemma import Gemma2ForCausalLM
from .rotary import RotaryEmbedding, default_inv_freq
from .shape import DecoderShape

_TYPES = ("sliding_attention", "full_attention")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gguf_architectures = ("gemma3",)  # the config is built from llama.cpp's metadata (model/source.py)

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.qk_norm = "head"
        return shape

    @classmethod
    def rope_layer_types(cls, config) -> list[str | None]:
        return list(_TYPES) if _per_layer_type(config) else [None]

    @classmethod
    def make_rotaries(cls, config, shape: DecoderShape, max_positions: int) -> list[RotaryEmbedding | None]:
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * shape.num_layers)
        if _per_layer_type(config):
            by_type = {t: RotaryEmbedding.from_config(config, shape.head_dim, max_positions, layer_type=t)
                       for t in _TYPES}
        else:  # older configs: one rope_theta for global layers, rope_local_base_freq for local ones
            local_base = float(getattr(config, "rope_local_base_freq", 10000.0))
            by_type = {"full_attention": RotaryEmbedding.from_config(config, shape.head_dim, max_positions),
                       "sliding_attention": RotaryEmbedding(default_inv_freq(local_base, shape.head_dim), 1.0,
                                                            max_positions)}
        return [by_type[t] for t in types]


def _per_layer_type(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return all(isinstance(params.get(t), dict) for t in _TYPES)


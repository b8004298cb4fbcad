"""Granite (IBM): Llama with four multipliers from its config.

``embedding_multiplier`` scales the embeddings, ``attention_multiplier`` is the softmax scale,
``residual_multiplier`` scales each block's output before the residual add, and the logits are
divided by ``logits_scaling``. GGUF files carry them as ``attention.scale``, ``embedding_scale``,
``residual_scale`` and ``logit_scale`` (model/source.py builds the config).
"""

from __future__ import annotations

from .decoder import DecoderModel, FastPaths
from .shape import DecoderShape


class GraniteForCausalLM(DecoderModel):
    fast_paths = FastPaths(decode_stack=False)
    gguf_architectures = ("granite",)
    gguf_permuted_qk = True  # llama.cpp converts it as a Llama

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.embedding_scale = float(config.embedding_multiplier)
        shape.attention_scale = float(config.attention_multiplier)
        shape.residual_scale = float(config.residual_multiplier)
        shape.logit_divisor = float(config.logits_scaling)
        return shape

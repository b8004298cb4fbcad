"""SmolLM3 (Hugging Face): Llama with rope switched off in some layers (``no_rope_layers``: 1 = rope)
and optional sliding-window layers."""

from __future__ import annotations

from .decoder import DecoderModel
from .llama import layer_windows
from .shape import DecoderShape


class SmolLM3ForCausalLM(DecoderModel):
    gguf_architectures = ("smollm3",)
    gguf_permuted_qk = True  # llama.cpp converts it as a Llama

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        flags = tuple(bool(f) for f in (getattr(config, "no_rope_layers", None) or ()))
        shape.rope_layers = flags if flags and not all(flags) else ()
        shape.layer_windows = layer_windows(config, shape.num_layers)
        return shape

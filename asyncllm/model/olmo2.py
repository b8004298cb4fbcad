"""OLMo 2 (AI2): norms after each block instead of before, and q/k norms over the whole projection.

A layer is ``h += post_attention_norm(attn(h)); h += post_feedforward_norm(mlp(h))``, and q and k are
RMS-normed across all heads before rope. That norm spans heads, so a tensor-parallel rank (which
holds some heads) cannot compute it alone: OLMo 2 runs on one device.
"""

from __future__ import annotations

from .decoder import DecoderModel, FastPaths
from .shape import DecoderShape


class Olmo2ForCausalLM(DecoderModel):
    fast_paths = FastPaths(decode_stack=False, tensor_parallel=False)
    gguf_architectures = ("olmo2",)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.layout, shape.qk_norm = "post", "full"
        return shape

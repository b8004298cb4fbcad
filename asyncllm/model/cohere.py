"""Cohere Command-R (``CohereForCausalLM``): a parallel block, LayerNorm, interleaved rope, scaled logits.

A layer computes attention and MLP from the same normed input and adds both to the residual; the
norm is a LayerNorm without bias; rope pairs neighbouring dimensions; the tied LM head's logits
are multiplied by ``logit_scale``. The q/k LayerNorms of Command R+ (``use_qk_norm``) are refused.
"""

from __future__ import annotations

from ..errors import ModelLoadError
from .decoder import DecoderModel, FastPaths
from .shape import DecoderShape


class CohereForCausalLM(DecoderModel):
    interleaved_rope = True
    gguf_architectures = ("command-r",)
    fast_paths = FastPaths(decode_stack=False)

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.rms_norm_eps = float(config.layer_norm_eps)
        shape.layout, shape.norm = "parallel", "layer"
        shape.logit_scale = float(config.logit_scale)
        return shape

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if getattr(config, "use_qk_norm", False):
            raise ModelLoadError("CohereForCausalLM: q/k LayerNorms (config key use_qk_norm) are not supported")

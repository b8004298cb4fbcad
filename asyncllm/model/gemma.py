"""Gemma and Gemma 2: the decoder with Gemma's habits.

Both scale the embeddings by sqrt(hidden_size), use a GELU (tanh-approximated) in the gated MLP, and
norm with ``x * (1 + weight)`` (the +1 is folded into the weights at load, so the shared RMSNorm
kernels run them). Gemma 2 adds sandwich norms (each block's output is normed before the residual),
a softmax scale of ``query_pre_attn_scalar ** -0.5``, tanh soft-capping of the attention scores
and of the final logits, and sliding-window layers alternating with global ones (``layer_types``).
"""

from __future__ import annotations

import torch

from .decoder import DecoderModel, FastPaths
from .llama import layer_windows
from .shape import DecoderShape

GELU = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


class GemmaForCausalLM(DecoderModel):
    activations = GELU
    gguf_architectures = ("gemma",)
    fast_paths = FastPaths(decode_stack=False)

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.norm_offset = True
        shape.embedding_scale = config.hidden_size ** 0.5
        return shape


    @classmethod
    def prepare_weight(cls, name: str, tensor: torch.Tensor, from_gguf: bool = False) -> torch.Tensor:
        # llama.cpp's converter stores these norms with the +1 added already
        return tensor.float() + 1.0 if name.endswith("norm.weight") and not from_gguf else tensor


class Gemma2ForCausalLM(GemmaForCausalLM):
    gguf_architectures = ("gemma2",)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}

    @classmethod
    def activation_of(cls, config) -> str:
        return getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.layout = "sandwich"
        shape.attention_scale = config.query_pre_attn_scalar ** -0.5
        shape.attn_softcap = getattr(config, "attn_logit_softcapping", None)
        shape.final_softcap = getattr(config, "final_logit_softcapping", None)
        shape.layer_windows = layer_windows(config, shape.num_layers)
        return shape

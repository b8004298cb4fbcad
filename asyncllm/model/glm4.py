"""GLM-4 (``Glm4ForCausalLM``): sandwich norms, half-width interleaved rope, q/k/v biases.

Its checkpoints keep q/k/v apart but store ``gate_up_proj`` fused (gate rows, then up), and name
the four norms of a layer differently from Gemma's sandwich: ``renamed`` maps them.
"""

from __future__ import annotations

from .decoder import DecoderModel, FastPaths
from .shape import DecoderShape


class Glm4ForCausalLM(DecoderModel):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    renamed = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    gguf_architectures = ("glm4",)
    # GGUF names -> the checkpoint's (then renamed above): llama.cpp's names follow the norms' roles
    gguf_names = {"post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
                  "post_ffw_norm": "post_mlp_layernorm", "ffn_up": "mlp.gate_up_proj"}
    interleaved_rope = True
    bias_on_o_proj = False
    fast_paths = FastPaths(decode_stack=False)

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.layout = "sandwich"
        return shape

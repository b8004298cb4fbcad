"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama decoder with fused checkpoints.

Its checkpoints store ``qkv_proj`` (q rows, then k, then v) and ``gate_up_proj`` (gate rows, then
up) fused exactly as the engine keeps them, so nothing is packed at load. Phi-4-mini rotates only
part of each head (``partial_rotary_factor``, 0.75) and the 128k-context models use "longrope"
(model/rotary.py); a sliding window (Phi-3-mini-4k has 2,047) is a real window in attention.
"""

from __future__ import annotations

from .decoder import DecoderModel
from .llama import layer_windows
from .shape import DecoderShape


class Phi3ForCausalLM(DecoderModel):
    packed_modules = {}
    lora_targets = ()  # PEFT adapters for Phi-3 target the fused modules, which the slots do not split
    gguf_architectures = ("phi3",)
    gguf_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # stored fused, as the engine

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.layer_windows = layer_windows(config, shape.num_layers)
        return shape

"""gpt-oss (OpenAI): attention with sinks on alternating sliding-window and full layers, and a sparse MLP of
clamped-SwiGLU experts with biases in every layer.

* Attention: q/k/v and o_proj biases (``attention_bias``), yarn rope, ``layer_types`` alternating
  ``sliding_attention`` (window ``sliding_window``) and ``full_attention``; each head has a learnt logit
  ``self_attn.sinks`` that joins its softmax's denominator and attends to nothing (the kernels' ``sinks``).
* MLP: a router with a bias keeps each token's ``num_experts_per_tok`` best logits and softmaxes them among
  themselves; the experts are stacked ``gate_up_proj`` [E, H, 2I] (gate and up columns alternating) and
  ``down_proj`` [E, I, H], each with a bias, and compute ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(gate, limit)`` (``swiglu_alpha``, ``swiglu_limit``; model/moe.py).

The checkpoints OpenAI publishes store the experts in MXFP4 (``quantization_config.quant_method`` "mxfp4"):
the expert stack dequantizes them as it loads them (model/mxfp4.py), exactly, into the model's dtype; the rest
of such a checkpoint is bf16, and the engine runs it as a float checkpoint.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM
from .mixtral import MoEFamily
from .moe import moe_shape
from .mxfp4 import METHOD
from .shape import DecoderShape


class GptOssForCausalLM(MoEFamily, LlamaForCausalLM):
    renamed = {"router": "gate"}
    dequantized_formats = (METHOD,)

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)  # layer_types' windows; attention_bias on q/k/v and o_proj
        shape.attn_sinks = True
        shape.moe = moe_shape(config, router="topk_softmax", activation="swiglu_clamped", expert_bias=True,
                              router_bias=True, gate_up_interleaved=True,
                              swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                              swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)))
        return shape

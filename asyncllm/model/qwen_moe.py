"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with sparse MLPs.

Both softmax the router's logits and keep the top ``num_experts_per_tok``, renormalised when
``norm_topk_prob`` is set. A layer is sparse when it is not in ``mlp_only_layers`` and its number plus one
is a multiple of ``decoder_sparse_step``; the others have a dense MLP of ``intermediate_size``. Qwen2-MoE
adds a shared expert whose output is scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from .llama import Qwen2ForCausalLM, Qwen3ForCausalLM
from .mixtral import MoEFamily
from .moe import moe_shape
from .shape import DecoderShape


def sparse_layers(config, num_layers: int) -> tuple:
    """Per layer, whether its MLP is the sparse one (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


class Qwen2MoeForCausalLM(MoEFamily, Qwen2ForCausalLM):

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.qkv_bias = bool(getattr(config, "qkv_bias", True))
        shape.moe = moe_shape(config, renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              shared_intermediate_size=int(config.shared_expert_intermediate_size or 0),
                              shared_gate=True)
        shape.moe_layers = sparse_layers(config, shape.num_layers)
        return shape


class Qwen3MoeForCausalLM(MoEFamily, Qwen3ForCausalLM):

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.moe = moe_shape(config, renormalize=bool(getattr(config, "norm_topk_prob", True)))
        shape.moe_layers = sparse_layers(config, shape.num_layers)
        return shape

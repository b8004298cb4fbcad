"""Mixtral: Mistral's attention with a sparse MLP of SiLU-gated experts in every layer.

The router softmaxes every expert's logit, keeps each token's ``num_experts_per_tok`` best and renormalises
them to sum to one (model/moe.py). Checkpoints store one ``w1``/``w3``/``w2`` tensor per expert under
``block_sparse_moe``, read here as the engine's ``mlp``.
"""

from __future__ import annotations

from .decoder import FastPaths
from .llama import LlamaForCausalLM
from .moe import moe_shape
from .shape import DecoderShape

# what a mixture-of-experts family may use: the C decode stack and CUDA graphs run dense MLPs only
MOE_FAST_PATHS = FastPaths(decode_stack=False, cuda_graphs=False)
# adapters touch the attention projections (as modules) and the stacked experts (PEFT target_parameters)
ATTENTION_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class MoEFamily:
    """The declaration every mixture-of-experts family shares (listed first among its bases): no C decode
    stack or CUDA graphs, LoRA on the attention projections and on the experts' ``gate_up_proj`` /
    ``down_proj`` parameters (``expert_lora``: where transformers stacks them [E, out, in], gate rows before
    up rows, as PEFT adapts them), no GGUF files."""

    fast_paths = MOE_FAST_PATHS
    lora_targets = ATTENTION_LORA_TARGETS
    expert_lora = True
    gguf_architectures: tuple[str, ...] = ()


class MixtralForCausalLM(MoEFamily, LlamaForCausalLM):
    renamed = {"block_sparse_moe": "mlp"}

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.moe = moe_shape(config, router="softmax_topk", renormalize=True)
        return shape

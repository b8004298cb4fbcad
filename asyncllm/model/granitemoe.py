"""GraniteMoe (IBM): Granite's multipliers with a sparse MLP in every layer.

Its router keeps each token's ``num_experts_per_tok`` best logits and softmaxes them among themselves.
Checkpoints store every expert's gate/up rows stacked in ``input_linear`` ([E, 2I, H]) and the down
projections in ``output_linear`` ([E, H, I]) under ``block_sparse_moe``, with the router at
``router.layer``; they are read as the engine's ``mlp.experts`` and ``mlp.gate``.
"""

from __future__ import annotations

from .granite import GraniteForCausalLM
from .mixtral import MoEFamily
from .moe import moe_shape
from .shape import DecoderShape


class GraniteMoeForCausalLM(MoEFamily, GraniteForCausalLM):
    renamed = {"router.layer": "gate", "block_sparse_moe": "mlp",
               "input_linear": "experts.input_linear", "output_linear": "experts.output_linear"}

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.moe = moe_shape(config, router="topk_softmax")
        return shape

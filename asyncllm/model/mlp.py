"""The dense gated MLP (gate and up fused into one column-parallel matmul, then down, row-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel import SINGLE, TensorParallel
from ..kernels.ops import silu_and_mul
from .layers import MergedColumnParallelLinear, RowParallelLinear
from .shape import DecoderShape


def _activation(name: str):
    if name == "silu":
        return silu_and_mul
    if name == "gelu_tanh":
        return lambda gate, up: F.gelu(gate, approximate="tanh") * up
    return lambda gate, up: F.gelu(gate) * up


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape, layer_index: int = 0, lora=None, tp: TensorParallel = SINGLE,
                 full: DecoderShape | None = None) -> None:
        super().__init__()
        full = full or shape
        self.layer_index, self.lora, self.tp = layer_index, lora, tp
        self.gate_up_proj = MergedColumnParallelLinear(shape.hidden_size, [full.intermediate_size] * 2,
                                                       shape.mlp_bias, tp)
        self.down_proj = RowParallelLinear(shape.intermediate_size, shape.hidden_size, shape.mlp_bias,
                                           tp.split(full.intermediate_size), tp)
        self.act_and_mul = _activation(shape.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        lora = self.lora if self.lora is not None and self.lora.groups else None
        if lora:
            lora.apply(self.layer_index, "gate_up_proj", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.act_and_mul(gate, up)
        out = self.down_proj(hidden)
        if lora:
            lora.apply(self.layer_index, "down_proj", hidden, out)
        return self.tp.all_reduce(out)

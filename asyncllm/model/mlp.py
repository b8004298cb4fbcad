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
        if self.bf16_activations_apply():
            return self._forward_bf16(x)
        lora = self.lora if self.lora is not None and self.lora.groups else None
        gate_up = self.gate_up_proj(x)
        if lora:
            lora.apply(self.layer_index, "gate_up_proj", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.act_and_mul(gate, up)
        out = self.down_proj(hidden)
        if lora:
            lora.apply(self.layer_index, "down_proj", hidden, out)
        return self.tp.all_reduce(out)

    def _bf16_matmuls(self) -> bool:
        """Both projections packed for oneDNN's bf16 matmuls (dtype="bfloat16" on CPU, kernels/cpu_linear.py)."""
        return (getattr(self.gate_up_proj, "compute_dtype", None) == torch.bfloat16
                and getattr(self.down_proj, "compute_dtype", None) == torch.bfloat16)

    def bf16_activations_apply(self) -> bool:
        """Whether this call would run :meth:`_forward_bf16` (no adapter in the batch, both matmuls in bf16)."""
        return (self.lora is None or not self.lora.groups) and self._bf16_matmuls()

    def _forward_bf16(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The MLP with its activations bf16 from gate_up's output to down's input: gate_up hands back bf16, the
        activation reads and writes bf16 (computing in float32), and down returns ``x``'s dtype. Against
        widening to float32 in between, this drops two conversion passes over the widest tensors of the layer
        (2 x intermediate, then intermediate wide) and halves the activation's memory traffic, with the same
        numbers: oneDNN's bf16 matmul rounds its output to bf16 anyway, and down rounded its input to bf16.
        ``out_dtype`` (default ``x``'s): bf16 hands down's output back as oneDNN rounded it (the bf16 residual path
        of model/decoder.py adds it to the float32 residual in the next norm's pass)."""
        gate_up = self.gate_up_proj.forward_as(x, torch.bfloat16)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj.forward_as(self.act_and_mul(gate, up), out_dtype or x.dtype))

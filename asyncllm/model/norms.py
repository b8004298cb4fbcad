"""The decoder's norms: RMSNorm and bias-free LayerNorm, in float32 as transformers computes them."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.ops import add_rms_norm, rms_norm, rms_norm_as
from .shape import DecoderShape


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does, then cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)), fused into one kernel where Triton ops are on."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def add_and_norm_as(self, x: torch.Tensor, residual: torch.Tensor | None,
                        dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(residual + x in float32, its norm in ``dtype``), or (None, norm(x) in ``dtype``) when ``residual`` is
        None: ``x`` may be a projection's bf16 output, added to the float32 residual without a conversion pass."""
        return rms_norm_as(x, residual, self.weight, self.eps, dtype)


class LayerNorm(nn.Module):
    """LayerNorm without bias, in float32 (Cohere's)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * ((x - mean) * torch.rsqrt(variance + self.eps))).to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return total, self(total)


def make_norm(shape: DecoderShape, size: int) -> nn.Module:
    return LayerNorm(size, shape.rms_norm_eps) if shape.norm == "layer" else RMSNorm(size, shape.rms_norm_eps)

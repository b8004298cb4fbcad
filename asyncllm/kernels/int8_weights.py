"""Symmetric weight-only int8 quantization: pure torch helpers (any device).

A weight ``W`` [N, K] is stored as ``qweight`` [N, K] int8 and ``scales`` [N, K // G] float32: every
output row is cut into groups of ``G`` consecutive input columns (``G = K``, one scale per output
channel, when no group size is given; ``G = 32`` is GGUF's Q8_0), and each group keeps
``scale = absmax / 127`` and ``q = round(w / scale)`` in [-127, 127]. The weight is then
``qweight * scale`` repeated over each group's columns (:func:`dequantize_weight`).
An all-zero group gets scale 1, so it dequantizes to exact zeros (never 0 / 0).
"""

from __future__ import annotations

import torch

QMAX = 127


def resolve_group_size(in_features: int, group_size: int | None) -> int:
    """The number of input columns per scale: ``group_size``, or ``in_features`` (per output channel)
    when it is None. Raises ValueError unless it is a positive divisor of ``in_features``."""
    if in_features <= 0:
        raise ValueError(f"the weight needs at least one input column, got {in_features}")
    if group_size is None:
        return in_features
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int or None, got {group_size!r}")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide the input width {in_features}")
    return group_size


def quantize_weight(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight int8 [N, K], scales float32 [N, K // G])`` for a float ``weight`` [N, K]
    (symmetric, ``scale = absmax / 127`` per group of ``G`` columns; ``G = K`` when ``group_size`` is None)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-d tensor [out_features, in_features], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
    n, k = weight.shape
    group = resolve_group_size(k, group_size)
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight holds NaN or infinite values; they cannot be quantized")
    absmax = w.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    qweight = torch.round(w / scales.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return qweight.reshape(n, k).contiguous(), scales.contiguous()


def check_quantized(qweight: torch.Tensor, scales: torch.Tensor) -> int:
    """Validate a ``(qweight, scales)`` pair and return its group size ``K // scales.shape[1]``."""
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-d int8 tensor, got "
                         f"{getattr(qweight, 'dtype', type(qweight).__name__)} {tuple(getattr(qweight, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or not scales.dtype.is_floating_point or scales.dim() != 2:
        raise ValueError(f"scales must be a 2-d float tensor, got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)} {tuple(getattr(scales, 'shape', ()))}")
    n, k = qweight.shape
    if scales.shape[0] != n:
        raise ValueError(f"scales has {scales.shape[0]} rows but qweight has {n}")
    groups = scales.shape[1]
    if groups <= 0 or k % groups:
        raise ValueError(f"scales' {groups} groups per row do not divide the input width {k}")
    if qweight.device != scales.device:
        raise ValueError(f"qweight is on {qweight.device} but scales on {scales.device}")
    return k // groups


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that ``(qweight, scales)`` stands for."""
    group = check_quantized(qweight, scales)
    n, k = qweight.shape
    w = qweight.reshape(n, k // group, group).to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k)

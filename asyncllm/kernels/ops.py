"""Elementwise decoder ops with a function-level choice between torch and fused Triton kernels.

The model always calls these functions. They run the torch code (the reference, and the CPU
path) unless the caller enabled Triton ops for the current context with :func:`triton_ops` and
the tensor is on CUDA (or on CPU under ``TRITON_INTERPRET=1``, which is how tests run the
kernels). The model runner enables them for the steps of an engine whose attention backend is
Triton. The choice is a ``ContextVar``, so two engines in one process never see each other's.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F

from .triton_utils import interpreting, triton_available

_enabled: ContextVar[bool] = ContextVar("asyncllm_triton_ops", default=False)


@contextmanager
def triton_ops(enabled: bool = True) -> Iterator[None]:
    """Use the fused Triton kernels (where the device allows) inside this block."""
    token = _enabled.set(enabled and triton_available())
    try:
        yield
    finally:
        _enabled.reset(token)


def use_triton(x: torch.Tensor) -> bool:
    return _enabled.get() and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (as transformers computes it), cast back, then scaled by ``weight``."""
    if use_triton(x):
        from .elementwise import rms_norm as fused

        return fused(x, weight, eps)[0]
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x)): the residual add and the next norm in one pass."""
    if use_triton(x):
        from .elementwise import rms_norm as fused

        normed, total = fused(x, weight, eps, residual=residual)
        return total, normed
    total = residual + x
    return total, rms_norm(total, weight, eps)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the gated activation of Llama-family MLPs."""
    if use_triton(gate):
        from .elementwise import silu_and_mul as fused

        return fused(gate, up)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q/k ([tokens, heads, head_dim]) by the angles at ``positions`` (tables of
    cat(freqs, freqs)). The Triton path rotates in place and returns the same tensors."""
    if use_triton(q):
        from .elementwise import rotary_embedding_

        rotary_embedding_(positions, q, k, cos, sin)
        return q, k
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

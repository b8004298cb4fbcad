"""Elementwise decoder ops with a function-level choice between torch and fused kernels.

The model always calls these functions. They run the torch code (the reference) unless the caller
enabled a kernel family for the current context:

- :func:`triton_ops`: the Triton kernels, for tensors on CUDA (or on CPU under ``TRITON_INTERPRET=1``,
  which is how tests run them). The runner enables them for engines on the Triton backend.
- :func:`cpu_ops`: the C kernels of ``csrc/elementwise.c``, for float32 CPU tensors (and bf16 ones
  where a kernel has a bf16 twin: SiLU-and-multiply). The runner
  enables them for engines on the ``cpu`` backend (so ``attention_backend="torch"`` stays pure torch).

The choice is a ``ContextVar``, so two engines in one process never see each other's.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F

from .triton_utils import interpreting, triton_available

_TRITON, _CPU = "triton", "cpu"
_family: ContextVar[str | None] = ContextVar("asyncllm_kernel_ops", default=None)


@contextmanager
def _use(family: str | None) -> Iterator[None]:
    token = _family.set(family)
    try:
        yield
    finally:
        _family.reset(token)


def triton_ops(enabled: bool = True):
    """Use the fused Triton kernels (where the device allows) inside this block."""
    return _use(_TRITON if enabled and triton_available() else None)


def cpu_ops(enabled: bool = True):
    """Use the fused C kernels for float32 CPU tensors inside this block (where they could be built)."""
    from . import cpu_ops as kernels

    return _use(_CPU if enabled and kernels.available() else None)


def use_triton(x: torch.Tensor) -> bool:
    return _family.get() == _TRITON and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def use_cpu(x: torch.Tensor) -> bool:
    return _family.get() == _CPU and x.device.type == "cpu" and x.dtype == torch.float32


def _cpu_bf16(x: torch.Tensor) -> bool:
    """A bf16 CPU tensor under the C family (the bf16 prefill MLP: kernels with a bf16 twin take it)."""
    return _family.get() == _CPU and x.device.type == "cpu" and x.dtype == torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (as transformers computes it), cast back, then scaled by ``weight``."""
    if use_triton(x):
        from .elementwise import rms_norm as fused

        return fused(x, weight, eps)[0]
    if use_cpu(x):
        from .cpu_ops import rms_norm as fused_cpu

        return fused_cpu(x, weight, eps)[0]
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
    if use_cpu(x) and residual.is_contiguous():
        from .cpu_ops import rms_norm as fused_cpu

        normed, total = fused_cpu(x, weight, eps, residual=residual)
        return total, normed
    total = residual + x
    return total, rms_norm(total, weight, eps)


def rms_norm_as(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(residual + x in float32, its rms_norm rounded to ``dtype``), or (None, rms_norm(x) in ``dtype``) without a
    residual: ``x`` a bf16 or float32 projection output, ``residual`` the float32 residual stream (the bf16 residual
    path of dtype="bfloat16" prefill, model/decoder.py). One C pass under the C family; elsewhere the same numbers
    in torch ops."""
    from . import cpu_ops as kernels

    plain = residual is None or (residual.dtype == torch.float32 and residual.is_contiguous())
    if (_family.get() == _CPU and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and plain
            and x.dtype in (torch.float32, torch.bfloat16) and (residual is not None or x.dtype == torch.float32)
            and dtype in (torch.float32, torch.bfloat16) and weight.dtype == torch.float32):
        normed, total = kernels.rms_norm_mixed(x, weight, eps, residual, dtype)
        return total, normed
    total = x.float() if residual is None else residual + x.float()
    return (None if residual is None else total), rms_norm(total, weight, eps).to(dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the gated activation of Llama-family MLPs."""
    if use_triton(gate):
        from .elementwise import silu_and_mul as fused

        return fused(gate, up)
    if (use_cpu(gate) or _cpu_bf16(gate)) and gate.dim() == 2:
        from .cpu_ops import silu_and_mul as fused_cpu

        return fused_cpu(gate, up)
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
    if use_cpu(q) and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]:
        from .cpu_ops import rotary_embedding_ as rotate_cpu

        rotate_cpu(positions, q, k, cos, sin)
        return q, k
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

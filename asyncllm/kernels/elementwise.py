"""Fused Triton kernels for the decoder's memory-bound elementwise ops.

Each replaces several torch launches (and the float32 round trips between them) with one pass,
and rounds to the model dtype exactly where the torch versions in :mod:`asyncllm.kernels.ops` do,
so the two agree to the last bit or two.

* RMSNorm, optionally fused with the residual add that precedes it.
* Rotary embedding (rotate-half / NeoX layout), in place on q and k.
* SiLU-and-multiply of the MLP's gate and up projections.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import next_power_of_2


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """View ``x`` ([..., n], last dim contiguous, at most 3-D) as rows: (rows, inner, outer stride,
    inner stride). Row ``r`` starts at ``(r // inner) * outer + (r % inner) * inner_stride``, so
    q/k views of a fused qkv projection are read in place."""
    if x.stride(-1) != 1 or x.dim() > 3:
        raise ValueError("expected at most 3 dims with a contiguous last dim")
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    inner, stride_xo, stride_xi, stride_ro, stride_ri, n, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + (row // inner) * stride_xo + (row % inner) * stride_xi + cols, mask=ok, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + (row // inner) * stride_ro + (row % inner) * stride_ri + cols, mask=ok, other=0.0)
        # round the sum to the model dtype, as the torch add it replaces does
        s = (x + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n + cols, s, mask=ok)
        x = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of the last dim of ``x`` (or of ``x + residual``). Returns (normed, sum or None),
    both contiguous and shaped like ``x``."""
    n = x.shape[-1]
    rows, inner, stride_o, stride_i = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else None
    r_outer = r_inner = 0
    if residual is not None:
        _, _, r_outer, r_inner = _rows(residual)
    if rows:
        block = next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, total if total is not None else out,
            inner, stride_o, stride_i, r_outer, r_inner, n, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)))
    return out, total


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    # The table is cat(freqs, freqs): its first half holds every angle once.
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    heads = tl.arange(0, HEADS_PAD)
    _rotate(q_ptr + token.to(tl.int64) * stride_qt, heads, j, stride_qh, cos, sin, NUM_Q_HEADS, HALF)
    _rotate(k_ptr + token.to(tl.int64) * stride_kt, heads, j, stride_kh, cos, sin, NUM_K_HEADS, HALF)


@triton.jit
def _rotate(base, heads, j, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr):
    ok = (heads < NUM_HEADS)[:, None] & (j < HALF)[None, :]
    first = base + heads[:, None] * stride_h + j[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=ok)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=ok)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """Rotate q ([tokens, heads, head_dim]) and k ([tokens, kv_heads, head_dim]) in place by the
    angles at ``positions``; cos/sin: [max_positions, head_dim] tables of cat(freqs, freqs)."""
    tokens, num_q, head_dim = q.shape
    if tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary_embedding_ needs a contiguous last dim")
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=num_q, NUM_K_HEADS=k.shape[1], HEADS_PAD=next_power_of_2(max(num_q, k.shape[1])),
        HALF=half, HALF_PAD=next_power_of_2(half), num_warps=4)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, n, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(gate_ptr + token * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + token * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds silu() first
    tl.store(out_ptr + token * n + cols, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [tokens, n] views (e.g. the halves of a fused gate/up projection)."""
    tokens, n = gate.shape
    out = torch.empty((tokens, n), dtype=gate.dtype, device=gate.device)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs a contiguous last dim")
    if tokens:
        block = min(1024, next_power_of_2(n))
        _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), n,
                                                              BLOCK=block, num_warps=4)
    return out

"""Weight-only int8 linear layer as a Triton kernel (CUDA; triton's interpreter on CPU for tests).

``y = x @ (q * scale).T (+ bias)`` for float16 / bfloat16 / float32 activations ``x`` [M, K], int8
weights ``q`` [N, K] (row-major, as :func:`~asyncllm.kernels.int8_weights.quantize_weight` returns
them) and float32 ``scales`` [N, K // G]; products accumulate in float32 and the output has x's dtype.

Each program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps: the int8 tile is
loaded and widened to the activation dtype in registers (exact: |q| <= 127 fits fp16 and bf16) and
goes through ``tl.dot``. Where the scales go depends on the grouping (``SCALE_MODE``):

- 0, one scale per output channel (G = K): applied once to the finished accumulator;
- 1, G a multiple of BLOCK_K (G = 32 takes BLOCK_K = 32): one scale per column for each K step,
  applied to that step's partial product;
- 2, any other G: each weight element is scaled before the dot (a gather of the scales).

Importing this module imports triton; :mod:`asyncllm.kernels.int8_linear` imports it only for CUDA
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import dot_flags, next_power_of_2


@triton.jit
def _int8_linear_kernel(X, Q, S, B, Y, M, N, K, G, stride_xm, stride_qn, stride_sn, stride_ym,
                        HAS_BIAS: tl.constexpr, SCALE_MODE: tl.constexpr, UPCAST: tl.constexpr,
                        IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    q_cols = Q + offs_n.to(tl.int64)[None, :] * stride_qn
    s_cols = S + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        q = tl.load(q_cols + offs_k[:, None], mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N]
        w = q.to(tl.float32)
        if SCALE_MODE == 2:
            w = w * tl.load(s_cols[None, :] + (offs_k // G)[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        if IEEE_DOT:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if SCALE_MODE == 1:
            acc += part * tl.load(s_cols + k0 // G, mask=mask_n, other=0.0)[None, :]
        else:
            acc += part
    if SCALE_MODE == 0:
        acc = acc * tl.load(s_cols, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _blocks(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SCALE_MODE) for a problem. Decode-sized M (<= 16) gets narrower
    column tiles so that more programs share the weight stream."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128
    block_n = min(block_n, max(16, next_power_of_2(n)))
    if group == k:
        return block_m, block_n, min(64, max(16, next_power_of_2(k))), 0
    for block_k in (64, 32, 16):
        if group % block_k == 0:
            return block_m, block_n, block_k, 1
    return block_m, block_n, min(64, max(16, next_power_of_2(k))), 2


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scales).T + bias`` for ``x`` [M, K] (fp16 / bf16 / fp32), ``qweight`` [N, K]
    int8, ``scales`` [N, K // G] float32 and ``bias`` [N] or None; returns [M, N] in x's dtype."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]:
        raise ValueError(f"qweight must be int8 [N, {x.shape[1]}], got {qweight.dtype} {tuple(qweight.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise ValueError(f"scales must be [{n}, groups] with groups dividing {k}, got {tuple(scales.shape)}")
    group = k // scales.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    if scales.dtype != torch.float32 or scales.stride(1) != 1:
        scales = scales.to(torch.float32).contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    if bias is not None:
        bias = bias.contiguous()
    block_m, block_n, block_k, mode = _blocks(m, n, k, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_linear_kernel[grid](
        x, qweight, scales, bias if bias is not None else scales, y, m, n, k, group,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SCALE_MODE=mode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **dot_flags(x.dtype))
    return y

"""Triton kernels for LoRA over a mixed batch: shrink (``x @ A.T``) and expand (``y += z @ B.T``).

Both are one *segmented gather matmul*: the step's tokens that use an adapter are listed segment
by segment (one segment per slot), and every program computes a tile of one segment's rows
against that segment's slot of the stacked weights. Shrink gathers its input rows from the hidden
states and writes a compact ``[rows, rank]`` result; expand reads that result and adds into the
gathered output rows (a column slice of a fused projection). Each output element belongs to one
program, so the accumulation needs no atomics. Ranks below the stack's ``max_rank`` are padded
with zeros in the stacks, so the padding contributes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import dot_flags, next_power_of_2


@triton.jit
def _segmented_matmul(X, X_ROWS, W, OUT, OUT_ROWS, SEG_START, SEG_SLOT,
                      K, N, stride_xm, stride_wslot, stride_wn, stride_wk, stride_om, out_col,
                      GATHER_X: tl.constexpr, SCATTER_OUT: tl.constexpr, ACCUMULATE: tl.constexpr,
                      UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(SEG_START + seg)
    end = tl.load(SEG_START + seg + 1)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 < end:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        x_rows = tl.load(X_ROWS + offs_m, mask=mask_m, other=0) if GATHER_X else offs_m
        slot = tl.load(SEG_SLOT + seg).to(tl.int64)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(X + x_rows[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(W + slot * stride_wslot + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            if IEEE_DOT:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        out_rows = tl.load(OUT_ROWS + offs_m, mask=mask_m, other=0) if SCATTER_OUT else offs_m
        ptrs = OUT + out_rows[:, None] * stride_om + out_col + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


def _launch(x, x_rows, w, out, out_rows, seg_start, seg_slot, max_seg_len, *, gather_x, scatter_out,
            accumulate, out_col=0) -> None:
    k, n = w.shape[2], w.shape[1]
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    grid = (seg_slot.numel(), triton.cdiv(max_seg_len, 16), triton.cdiv(n, block_n))
    _segmented_matmul[grid](
        x, x_rows, w, out, out_rows, seg_start, seg_slot, k, n, x.stride(0), w.stride(0), w.stride(1),
        w.stride(2), out.stride(0), out_col, GATHER_X=gather_x, SCATTER_OUT=scatter_out,
        ACCUMULATE=accumulate, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, **dot_flags(x.dtype))


def lora_shrink(x: torch.Tensor, rows: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                a_stack: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """``out[m] = x[rows[m]] @ A[slot of m].T``: [len(rows), max_rank] (rows listed segment by segment)."""
    out = torch.empty(rows.numel(), a_stack.shape[1], device=x.device, dtype=x.dtype)
    _launch(x, rows, a_stack, out, rows, seg_start, seg_slot, max_seg_len,
            gather_x=True, scatter_out=False, accumulate=False)
    return out


def lora_expand(z: torch.Tensor, y: torch.Tensor, out_col: int, rows: torch.Tensor, seg_start: torch.Tensor,
                seg_slot: torch.Tensor, b_stack: torch.Tensor, max_seg_len: int) -> None:
    """``y[rows[m], out_col:out_col+out] += z[m] @ B[slot of m].T`` in place (y contiguous)."""
    _launch(z, rows, b_stack, y, rows, seg_start, seg_slot, max_seg_len,
            gather_x=False, scatter_out=True, accumulate=True, out_col=out_col)

"""Quantized-weight linear layers as Triton kernels (CUDA; triton's interpreter on CPU for tests).

Two kernels over the layouts of :mod:`asyncllm.kernels.quant_linear`, each computing a
``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W.T (+ bias)`` for float16 / bfloat16 / float32 activations
``x`` [M, K], walking K in ``BLOCK_K`` steps with float32 accumulation; the output has x's dtype.
The weight is only ever widened in registers, one tile at a time.

:func:`group_quant_linear` (W4A16 / W8A16): ``packed`` uint8, ``[N, K // 2]`` nibbles (low nibble column
``2j``, high nibble ``2j + 1``) with ``bits=4`` or ``[N, K]`` bytes with ``bits=8``, values unsigned;
float32 ``scales`` and ``zeros`` ``[N, K // G]``, ``W[n, k] = (q - zeros[n, k // G]) * scales[n, k // G]``.
Each step loads the packed bytes of a ``[BLOCK_N, BLOCK_K]`` tile (contiguous along K: one byte holds two
columns), splits the nibbles (``tl.join`` + ``tl.reshape`` puts them back in column order), subtracts the
zero points and goes through ``tl.dot``. Where the scales go depends on the grouping (``SCALE_MODE``):

- 1, G a multiple of BLOCK_K (the checkpoints' 32 / 64 / 128, and one group per row when K is a
  multiple of 16): BLOCK_K divides G, so every K step lies in one group: ``q - zero`` (small integers,
  exact in fp16 and bf16) goes into the dot and the step's partial product is multiplied by that
  group's scale per column;
- 2, any other G: each weight element is dequantized, ``(q - zero) * scale``, before the dot.

:func:`fp8_linear` (W8A16 with ``float8_e4m3fn`` weights): ``weight`` [N, K] and float32 ``scale``
``[ceil(N / block_n), 1]`` (one per row, or per block of ``block_n`` rows; one value for the tensor) or
``[ceil(N / block_n), ceil(K / block_k)]`` (DeepSeek's / Qwen's 128x128 ``weight_scale_inv``). The fp8
tile is widened in registers (exact: every e4m3 value is an fp16 and a bf16 value) and goes through
``tl.dot``; scales: mode 0 (one per row) on the finished accumulator, mode 1 (BLOCK_K divides
``block_k``) per K step, mode 2 per element. Widening: on sm_89 and later (and in the interpreter)
triton's own ``float8e4nv`` conversion; before sm_89 triton has no e4m3 type, so the bytes are read as
uint8 and rebuilt bit by bit as float16 (sign to bit 15, exponent and mantissa shifted up by 7, times
2**8: exact, subnormals included; the NaN bytes 0x7F / 0xFF become +-480, which no checkpoint holds).

Not done: an fp8 x fp8 ``tl.dot`` (activations quantized per token to e4m3 on sm_89+). It changes the
numerics (activation rounding to 3 mantissa bits), so it needs its own accuracy bar and a GPU to check
it and its speed on; none was available when this was written. Both kernels widen the weight to the
activation dtype and use the 16-bit tensor-core path.

Checked so far only under ``TRITON_INTERPRET=1`` and by compiling for sm_90 / sm_80 without a GPU
(``tests/test_triton_quant_linear.py``); the tile sizes in :func:`_blocks` are untuned.

Importing this module imports triton; :mod:`asyncllm.kernels.quant_linear` imports it only for CUDA
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import dot_flags, interpreting, next_power_of_2


@triton.jit
def _group_quant_linear_kernel(X, P, S, Z, B, Y, M, N, K, G, stride_xm, stride_pn, stride_sn, stride_zn,
                               stride_ym, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_MODE: tl.constexpr,
                               UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    p_rows = P + offs_n.to(tl.int64)[:, None] * stride_pn      # [BLOCK_N, 1]: a weight row runs along K
    s_rows = S + offs_n.to(tl.int64) * stride_sn
    z_rows = Z + offs_n.to(tl.int64) * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if BITS == 4:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(p_rows + offs_b[None, :], mask=mask_n[:, None] & (offs_b < K // 2)[None, :],
                           other=0).to(tl.int32)
            # [BLOCK_N, BLOCK_K // 2, 2] (low nibble first) -> [BLOCK_N, BLOCK_K], columns in order
            q = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K))
        else:
            q = tl.load(p_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0).to(tl.int32)
        w = q.to(tl.float32)
        if SCALE_MODE == 1:
            group = k0 // G
            w = w - tl.load(z_rows + group, mask=mask_n, other=0.0)[:, None]
        else:
            w_mask = mask_n[:, None] & mask_k[None, :]
            group_k = (offs_k // G)[None, :]
            w = ((w - tl.load(z_rows[:, None] + group_k, mask=w_mask, other=0.0))
                 * tl.load(s_rows[:, None] + group_k, mask=w_mask, other=0.0))
        if UPCAST:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        w = tl.trans(w)  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if SCALE_MODE == 1:
            acc += part * tl.load(s_rows + group, mask=mask_n, other=0.0)[None, :]
        else:
            acc += part
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_linear_kernel(X, W, S, B, Y, M, N, K, SCALE_BK, SCALE_BN, stride_xm, stride_wn, stride_sn, stride_ym,
                       NATIVE_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_MODE: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = S + (offs_n // SCALE_BN).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_n[:, None] & mask_k[None, :]
        if NATIVE_FP8:  # W: float8e4nv
            w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        else:  # W: the same bytes as uint8; e4m3 -> fp16 bits: sign to bit 15, exponent+mantissa << 7
            byte = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0).to(tl.int32)
            half = (((byte & 0x80) << 8) | ((byte & 0x7F) << 7)).to(tl.int16)
            w = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0  # exponent bias 15 - 7
        if SCALE_MODE == 2:
            w = w * tl.load(s_rows[:, None] + (offs_k // SCALE_BK)[None, :], mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        w = tl.trans(w)  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if SCALE_MODE == 1:
            acc += part * tl.load(s_rows + k0 // SCALE_BK, mask=mask_n, other=0.0)[None, :]
        else:
            acc += part
    if SCALE_MODE == 0:
        acc = acc * tl.load(s_rows, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _blocks(m: int, n: int, k: int, group: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SCALE_MODE) for a problem whose scales change every ``group`` columns
    of K (None: one scale per row). Decode-sized M (<= 16) gets narrower column tiles so that more
    programs share the weight stream. Untuned: chosen as for the int8 kernel, not measured."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128
    block_n = min(block_n, max(16, next_power_of_2(n)))
    if group is None:
        return block_m, block_n, min(64, max(16, next_power_of_2(k))), 0
    for block_k in (64, 32, 16):
        if group % block_k == 0:
            return block_m, block_n, block_k, 1
    return block_m, block_n, min(64, max(16, next_power_of_2(k))), 2


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (what the kernels' pointer arithmetic assumes)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return bias.contiguous()


def group_quant_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       bits: int = 4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` over the group-quantized layout (module doc): ``x`` [M, K] fp16 / bf16 / fp32,
    ``packed`` uint8 ``[N, K // 2]`` (4 bits) or ``[N, K]`` (8 bits), ``scales`` / ``zeros`` ``[N, K // G]``,
    ``bias`` [N] or None. Returns [M, N] in x's dtype. Columns are in stored order: an act-order layer's
    input is gathered (``x[:, perm]``) by the caller."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    n = packed.shape[0]
    k = packed.shape[1] * (2 if bits == 4 else 1)
    _check_x(x, k)
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        raise ValueError(f"scales must be [{n}, groups] with groups dividing {k}, got {tuple(scales.shape)}")
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros must have the scales' shape {tuple(scales.shape)}, got {tuple(zeros.shape)}")
    group = k // scales.shape[1]
    m = x.shape[0]
    x, packed = _rows(x), _rows(packed)
    scales, zeros = _rows(scales.to(torch.float32)), _rows(zeros.to(torch.float32))
    bias = _bias(bias, n)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    block_m, block_n, block_k, mode = _blocks(m, n, k, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _group_quant_linear_kernel[grid](
        x, packed, scales, zeros, bias if bias is not None else scales, y, m, n, k, group,
        x.stride(0), packed.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, SCALE_MODE=mode, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, **dot_flags(x.dtype))
    return y


def native_fp8(device: torch.device) -> bool:
    """Whether triton has the e4m3 type on ``device``: CUDA sm_89 and later, and the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return interpreting()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int | None = None,
               bias: torch.Tensor | None = None, *, block_n: int = 1,
               native: bool | None = None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` for ``x`` [M, K] fp16 / bf16 / fp32 and ``float8_e4m3fn``
    ``weight`` [N, K]. ``scale`` float32: one value (the whole tensor), ``[R, 1]`` (one per block of
    ``block_n`` rows, R = ceil(N / block_n); ``block_n=1``: per row) or ``[R, ceil(K / block_k)]``
    (one per block of ``block_n`` rows and ``block_k`` columns). ``native``: widen with triton's e4m3
    type (default where it exists, :func:`native_fp8`) or from the raw bytes. Returns [M, N] in x's dtype."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    _check_x(x, k)
    if scale.numel() == 1:  # per tensor: one block of every row
        scale, block_n = scale.reshape(1, 1), max(1, n)
    if block_n < 1:
        raise ValueError(f"block_n must be positive, got {block_n}")
    rows = -(-n // block_n)
    if scale.dim() != 2 or scale.shape[0] != rows:
        raise ValueError(f"scale must be [{rows}, 1 or ceil(K / block_k)], got {tuple(scale.shape)}")
    if scale.shape[1] == 1:
        scale_bk = max(1, k)
        group = None
    else:
        if not block_k or scale.shape[1] != -(-k // block_k):
            raise ValueError(f"scale {tuple(scale.shape)} needs block_k with ceil({k} / block_k) = "
                             f"{scale.shape[1]}, got block_k={block_k}")
        scale_bk = group = block_k
    if native is None:
        native = native_fp8(x.device)
    m = x.shape[0]
    x, weight, scale = _rows(x), _rows(weight), _rows(scale.to(torch.float32))
    bias = _bias(bias, n)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    block_m, block_n_tile, block_k_tile, mode = _blocks(m, n, k, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n_tile))
    _fp8_linear_kernel[grid](
        x, weight if native else weight.view(torch.uint8), scale, bias if bias is not None else scale, y,
        m, n, k, scale_bk, block_n, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        NATIVE_FP8=native, HAS_BIAS=bias is not None, SCALE_MODE=mode, BLOCK_M=block_m, BLOCK_N=block_n_tile,
        BLOCK_K=block_k_tile, **dot_flags(x.dtype))
    return y

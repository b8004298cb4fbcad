"""Linear layers over weights kept as a quantized checkpoint stores them (GPTQ, AWQ, compressed-tensors, FP8).

Every packed integer format is brought, at load, to one layout that the kernels read
(:class:`GroupQuantLinear`):

- ``packed``: uint8. With 4 bits it is ``[N, K // 2]``: the low nibble holds column ``2j`` and the high nibble
  column ``2j + 1``. With 8 bits it is ``[N, K]``. The values are unsigned, from 0 to ``2**bits - 1``.
- ``scales``, ``zeros``: float32 ``[N, K // group_size]``. The weight is
  ``W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]``. ``zeros`` is the zero point in quantized
  units, so a symmetric 4-bit checkpoint has 8 everywhere.
- ``perm``: int64 ``[K]`` or None. With act-order (GPTQ ``desc_act``) the columns are stored sorted by group,
  and the input is gathered the same way: ``y = x[:, perm] @ W.T``.
- ``in_features`` below the stored width: the last group is partial (GPTQ on 576 columns in groups of 128);
  the stored weight has zero columns up to whole groups, and the input is padded with zeros to match.
- ``group_index``: int64 ``[K]`` or None: the group of each stored column, where groups are not runs of
  ``K // groups`` columns (an act-order layer cut by tensor parallelism: a rank's columns come from any
  group, unevenly). Only the torch path takes it.

The weight is never widened to float in memory except transiently, one layer at a time, in the torch
reference path. That path is the oracle of the faster kernels' tests.

:class:`Fp8Linear` keeps ``float8_e4m3fn`` weights with float32 scales: one per tensor, per output row, or per
``block`` (DeepSeek's and Qwen's 128x128 ``weight_scale_inv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_int4_linear import int4_linear_cpu, uint8_linear_cpu

# dtype="bfloat16" on CPU: calls of this many rows or more take the dequantize-to-bf16 path. Measured on SmolLM2's
# shapes (docs/quantization.md): at 2,048 rows it is 5-6x the 4-bit kernel; dequantizing one layer costs 0.8-6 ms,
# which the faster matmul repays from about 70-170 rows, so 256 leaves decode-sized mixed steps on the C kernel
GROUP_QUANT_BF16_ROWS = 256


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K // 2]`` uint8 nibbles as ``[N, K]`` uint8 values (low nibble first)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values 0..15 as ``[N, K // 2]`` uint8 nibbles (the inverse of :func:`unpack_int4`)."""
    values = values.to(torch.uint8)
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


def dequantize_groups(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                      dtype: torch.dtype = torch.float32, group_index: torch.Tensor | None = None) -> torch.Tensor:
    """The float ``[N, K]`` weight of the layout above (columns in stored order)."""
    q = unpack_int4(packed) if bits == 4 else packed
    n, k = q.shape
    if group_index is not None:  # uneven groups: each column's scale and zero point gathered
        return ((q.float() - zeros.float()[:, group_index]) * scales.float()[:, group_index]).to(dtype)
    group = k // scales.shape[1]
    q = q.float().reshape(n, scales.shape[1], group)
    weight = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return weight.reshape(n, k).to(dtype)


class GroupQuantLinear(nn.Module):
    """``y = x[:, perm] @ W.T + bias`` over the group-quantized layout of the module doc (4 or 8 bits)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                 group_index: torch.Tensor | None = None, in_features: int | None = None) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.out_features = packed.shape[0]
        self.stored_features = packed.shape[1] * (2 if bits == 4 else 1)
        self.in_features = in_features or self.stored_features
        if group_index is None and self.stored_features % scales.shape[1]:
            raise ValueError(f"{scales.shape[1]} groups do not divide {self.stored_features} input columns")
        if self.in_features != self.stored_features and (perm is not None or group_index is not None):
            raise ValueError("a partial last group cannot be combined with act-order")
        self.group_size = self.stored_features // scales.shape[1]
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("zeros", zeros.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.register_buffer("perm", None if perm is None else perm.long().contiguous())
        self.register_buffer("group_index", None if group_index is None else group_index.long().contiguous())
        # dtype="bfloat16" on CPU (model/runner.py): calls of at least this many rows (prefill chunks) dequantize the
        # weight to a transient bf16 copy and multiply through oneDNN's bf16 matmul; 0: never
        self.bf16_rows = 0

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, columns in stored (group-sorted) order."""
        return dequantize_groups(self.packed, self.scales, self.zeros, self.bits, dtype, self.group_index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stored_features != self.in_features:  # a partial last group: zero columns make it whole
            x = F.pad(x, (0, self.stored_features - self.in_features))
        if x.is_cuda:  # the Triton kernel (triton_quant_linear), where it applies
            y = _triton_group_forward(self, x)
            if y is not None:
                return y
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.bf16_rows and x.is_cpu and x.dtype is torch.float32 and x.numel() >= self.bf16_rows * x.shape[-1]:
            return self._bf16_matmul(x)
        if x.is_cpu and x.dtype is torch.float32:
            # the C kernel (cpu_int4_linear), straight from the packed weight; None where it does not apply.
            # The buffers come from one dict: nn.Module's attribute lookup costs ~0.6 us each, next to a
            # decode call of 10-100 us
            buffers = self._buffers
            if buffers["group_index"] is None:
                kernel = int4_linear_cpu if self.bits == 4 else uint8_linear_cpu
                y = kernel(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), buffers["packed"],
                           buffers["scales"], buffers["zeros"], buffers["bias"])
                if y is not None:
                    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def _bf16_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """A many-row call under dtype="bfloat16": bf16-rounded dequantized weights times bf16-rounded activations,
        float32 sums (oneDNN), float32 out. The dense copy lives for this call only (one layer's weight), so the
        model stays 4-bit in memory; at prefill sizes the dequantization is a few percent of the matmul."""
        y = F.linear(x.to(torch.bfloat16), self.dequantize(torch.bfloat16)).float()
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, act_order={self.perm is not None}")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight of an FP8 layer: ``weight * scale``. The scale is one value, one per row (``[N, 1]``),
    or one per ``block`` (``[ceil(N / bn), ceil(K / bk)]``)."""
    w = weight.float()
    if block is not None:
        bn, bk = block
        n, k = w.shape
        expanded = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (w * expanded).to(dtype)
    return (w * scale.float().reshape(-1, 1) if scale.numel() > 1 else w * scale.float().reshape(())).to(dtype)


class Fp8Linear(nn.Module):
    """``y = x @ (weight * scale).T + bias`` with ``float8_e4m3fn`` weights (see :func:`dequantize_fp8`)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block) if block is not None else None
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # the Triton kernel (triton_quant_linear), where it applies
            y = _triton_fp8_forward(self, x)
            if y is not None:
                return y
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


# ---- CUDA: the Triton kernels of .triton_quant_linear --------------------------------------------------

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_triton_module = None  # the kernels' module once looked up; False without triton


def _triton_kernels():
    """:mod:`.triton_quant_linear`, imported on first use (it imports triton), or None without triton."""
    global _triton_module
    if _triton_module is None:
        from .triton_utils import triton_available

        _triton_module = False
        if triton_available():
            from . import triton_quant_linear

            _triton_module = triton_quant_linear
    return _triton_module or None


def _triton_group_forward(layer: GroupQuantLinear, x: torch.Tensor) -> torch.Tensor | None:
    """``layer(x)`` through the Triton kernel, or None where it does not apply: no triton, weights not on
    CUDA, an activation dtype other than fp16 / bf16 / fp32, or uneven groups (``group_index``)."""
    if not layer.packed.is_cuda or x.dtype not in _TRITON_DTYPES or layer.group_index is not None:
        return None
    kernels = _triton_kernels()
    if kernels is None:
        return None
    if layer.perm is not None:
        x = x.index_select(-1, layer.perm)
    lead = x.shape[:-1]
    y = kernels.group_quant_linear(x.reshape(-1, x.shape[-1]), layer.packed, layer.scales, layer.zeros,
                                   layer.bits, layer.bias)
    return y.reshape(*lead, layer.out_features)


def _triton_fp8_forward(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor | None:
    """``layer(x)`` through the Triton kernel, or None where it does not apply (no triton, weights not on
    CUDA, an activation dtype other than fp16 / bf16 / fp32)."""
    if not layer.weight.is_cuda or x.dtype not in _TRITON_DTYPES:
        return None
    kernels = _triton_kernels()
    if kernels is None:
        return None
    if layer.block is None:  # one scale for the tensor, or one per row
        scale, block_n, block_k = layer.scale.reshape(-1, 1), 1, None
    else:
        (block_n, block_k), scale = layer.block, layer.scale
    lead = x.shape[:-1]
    y = kernels.fp8_linear(x.reshape(-1, layer.in_features), layer.weight, scale, block_k, layer.bias,
                           block_n=block_n)
    return y.reshape(*lead, layer.out_features)

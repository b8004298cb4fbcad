"""Weight-only int8 linear layers: int8 weights with float32 scales per group, float activations.

:class:`Int8Linear` computes ``y = x @ (qweight * scales).T + bias`` (see :mod:`.int8_weights` for
the format) and picks its kernel from the input:

- CPU, float32: the C kernel of ``csrc/int8_linear.c``, at every row count (with ``bf16_dot`` set, calls of
  more than 12 rows multiply bf16-rounded weights and activations with AVX512-BF16 dot products). Up to 12 rows
  (decode) it streams the int8 weight and widens it in registers (at one row it reads a quarter of
  the bytes the float32 oneDNN ``PackedLinear`` reads); for more rows it widens each 16-column
  panel to float32 once per 64 rows, in cache, and runs a float micro-kernel over the rows (12x16
  with AVX-512, 6x16 with AVX2: the same sums in the same order).
  Widening the whole weight per call and using torch's matmul was measured too and was slower at
  every size, prefill chunks included (``python -m benchmarks.int8_linear``, column ``i8 widen``).
- CUDA: the Triton kernel of :mod:`.triton_int8_linear` (fp16 / bf16 / fp32 activations);
- anything else (other dtypes on CPU, no compiler, no triton, ``ASYNCLLM_CPU_KERNELS=0``): the torch
  reference :func:`torch_int8_linear` (dequantize, then ``F.linear``).

The weight stays in its plain row-major ``qweight`` buffer (no repacked copy): every kernel reads
that layout, and so does the CPU decode stack (``kernels/cpu_decode_stack.py``), so the layer holds
its weight once and ``.to()`` / ``state_dict`` work as for any module.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_build import load_library
from .int8_weights import check_quantized, dequantize_weight, quantize_weight

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = (
    ("int8_linear_f32", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int), _int),
    ("int8_linear_bf16dot", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int), _int),
    ("int8_linear_has_bf16dot", (), _int),
)


def _library() -> ctypes.CDLL | None:
    return load_library("int8_linear", _SIGNATURES)


def bf16_dot_available() -> bool:
    """Whether this build's int8 kernel multiplies with bf16 dot products (AVX512-BF16): ``Int8Linear.bf16_dot``."""
    lib = _library()
    return lib is not None and bool(lib.int8_linear_has_bf16dot())


def cpu_kernel_available() -> bool:
    """Whether the C kernel could be built and loaded here (False under ``ASYNCLLM_CPU_KERNELS=0``)."""
    return _library() is not None


@functools.lru_cache(maxsize=1)
def _triton_linear():
    from .triton_utils import triton_available

    if not triton_available():
        return None
    from .triton_int8_linear import int8_linear

    return int8_linear


def torch_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear(x, dequantize_weight(qweight, scales), bias)`` in x's dtype."""
    weight = dequantize_weight(qweight, scales).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def cpu_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C kernel on checked arguments: ``x`` [M, K] float32 on CPU, ``qweight`` [N, K] int8,
    ``scales`` [N, K // G], ``bias`` [N] or None (all on CPU); returns [M, N] float32."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the int8 CPU kernel is not available here")
    group = check_quantized(qweight, scales)
    if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"x must be float32 [M, {qweight.shape[1]}] on CPU, got {x.dtype} {tuple(x.shape)} "
                         f"on {x.device}")
    if not qweight.is_cpu:
        raise ValueError("qweight and scales must be on CPU")
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight = qweight.contiguous()
    scales = scales.to(torch.float32).contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    n = qweight.shape[0]
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    rc = lib.int8_linear_f32(x.data_ptr(), x.stride(0), x.shape[0], qweight.data_ptr(), scales.data_ptr(),
                             None if bias is None else bias.data_ptr(), n, qweight.shape[1], group, y.data_ptr(),
                             y.stride(0), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"int8_linear_f32 failed ({'out of memory' if rc == 1 else 'bad shapes'})")
    return y


class Int8Linear(nn.Module):
    """``y = x @ (qweight * scales).T + bias`` with int8 ``qweight`` [N, K] and float32 ``scales``
    [N, K // G] (G = ``group_size``, inferred from the shapes; G = K is one scale per channel)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        group = check_quantized(qweight, scales)
        self.out_features, self.in_features = qweight.shape
        self.group_size = group
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.register_buffer("qweight", qweight.detach().contiguous())
        self.register_buffer("scales", scales.detach().to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._c_args: tuple | None = None
        # dtype="bfloat16" on int8 weights (model/runner.py): calls of more than 12 rows on CPU multiply
        # bf16-rounded weights and activations with bf16 dot products (csrc/int8_linear.c), twice the
        # multiply-adds per instruction of the float32 kernel
        self.bf16_dot = False

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   group_size: int | None = None) -> "Int8Linear":
        """Quantize a float ``weight`` [N, K] (symmetric, ``group_size`` columns per scale, or per channel)."""
        qweight, scales = quantize_weight(weight, group_size)
        return cls(qweight, scales, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None) -> "Int8Linear":
        return cls.from_float(linear.weight, linear.bias, group_size)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight the layer computes with, rebuilt on demand (for inspection)."""
        return dequantize_weight(self.qweight, self.scales)

    def _kernel_arguments(self) -> tuple | None:
        """The C kernel's per-layer arguments (weight, scales, bias pointers; N, K, G), or None when the
        layer is not on CPU or the kernel is unavailable. Made once, so that the Python side of a decode
        call costs little next to the kernel; remade when a buffer is replaced (``.to()``, assignment)."""
        key = (id(self.qweight), id(self.scales), id(self.bias))
        if self._c_args is None or self._c_args[0] != key:
            args = None
            if self.qweight.is_cpu and self.scales.is_cpu and _library() is not None:
                q = self.qweight.contiguous()
                s = self.scales.to(torch.float32).contiguous()
                b = None if self.bias is None else self.bias.detach().to(torch.float32).contiguous()
                args = ((q.data_ptr(), s.data_ptr(), None if b is None else b.data_ptr(), self.out_features,
                         self.in_features, self.group_size), (q, s, b))  # the tensors keep the pointers valid
            self._c_args = (key, args)
        args = self._c_args[1]
        return None if args is None else args[0]

    def _apply(self, fn, *args, **kwargs):
        self._c_args = None  # drop the references to the buffers before they are replaced
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        if x.dim() == 2:
            return self._forward_2d(x)
        lead = x.shape[:-1]
        return self._forward_2d(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)

    def _forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dtype is torch.float32:
            args = self._kernel_arguments()
            if args is not None:
                if x.stride(1) != 1:
                    x = x.contiguous()
                y = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
                lib = _library()
                kernel = lib.int8_linear_bf16dot if self.bf16_dot else lib.int8_linear_f32
                if kernel(x.data_ptr(), x.stride(0), x.shape[0], *args, y.data_ptr(), self.out_features,
                          torch.get_num_threads()):
                    raise RuntimeError("int8_linear: out of memory")
                return y
        elif x.is_cuda and self.qweight.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
            triton_linear = _triton_linear()
            if triton_linear is not None:
                return triton_linear(x, self.qweight, self.scales, self.bias)
        return torch_int8_linear(x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        group = "channel" if self.group_size == self.in_features else self.group_size
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={group}, "
                f"bias={self.bias is not None}")

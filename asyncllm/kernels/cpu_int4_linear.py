"""The CPU C kernel of 4-bit group-quantized linear layers (``csrc/int4_linear.c``), bound with ctypes.

:func:`int4_linear_cpu` computes ``x @ W.T + bias`` for the layout of :mod:`.quant_linear` (``packed``
uint8 ``[N, K // 2]``, low nibble first; float32 ``scales`` and ``zeros`` ``[N, K // G]``;
``W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]``) straight from the packed nibbles: the
weight is dequantized in registers (decode rows) or 16 output columns at a time into a per-thread
panel in cache (many rows), never into a full-size float copy. Each weight is rounded as the torch
reference (:func:`.quant_linear.dequantize_groups`) rounds it; only the order of the float32 sums
differs. :func:`uint8_linear_cpu` does the same for 8-bit weights (``packed`` uint8 ``[N, K]``).
Both return ``None`` where they do not run, and the caller takes the torch reference:

- no C compiler, a failed build, or ``ASYNCLLM_CPU_KERNELS=0`` (as for the int8 kernel);
- inputs that are not float32 2-D CPU tensors, or weights not on CPU;
- shapes the kernel does not take: K not a multiple of 32, or groups not a multiple of 32 columns
  (the checkpoints' 32, 64, 128 and one group per row all are).

Threads: the kernel splits output panels over OpenMP threads, ``torch.get_num_threads()`` of them,
from the libgomp that torch loaded (``cpu_build``), like ``int8_linear``.

The checked pointers of a layer's tensors are kept per ``packed`` tensor (a weak reference; the entry
goes with the tensor), so a decode call costs ~5 us of Python next to the kernel; a replaced buffer
(``.to()``, assignment) is a new tensor and is checked again, one written in place keeps its pointers.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from .cpu_build import load_library

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = (
    ("int4_linear_f32", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int), _int),
    ("uint8_linear_f32", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int), _int),
    ("int4_linear_isa", (), _int),
)


def _library() -> ctypes.CDLL | None:
    return load_library("int4_linear", _SIGNATURES)


def cpu_kernel_available() -> bool:
    """Whether the C kernel could be built and loaded here (False under ``ASYNCLLM_CPU_KERNELS=0``)."""
    return _library() is not None


def kernel_isa() -> str | None:
    """The code the loaded build runs: ``"avx512"``, ``"avx2"``, ``"scalar"``, or None without the kernel."""
    lib = _library()
    return None if lib is None else ("scalar", "avx2", "avx512")[lib.int4_linear_isa()]


def supported_shape(in_features: int, group_size: int) -> bool:
    """Whether the kernel takes K = ``in_features`` columns in groups of ``group_size``."""
    return in_features > 0 and in_features % 32 == 0 and group_size > 0 and group_size % 32 == 0 \
        and in_features % group_size == 0


def call_kernel(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, bias: torch.Tensor | None, group: int,
                num_threads: int | None = None, bits: int = 4) -> torch.Tensor:
    """``lib.int4_linear_f32`` (``uint8_linear_f32`` with ``bits=8``) on checked, contiguous arguments (x: unit
    stride along K); [M, N] float32. For the tests and benchmarks, which also pass other builds of the library."""
    n, k = packed.shape[0], x.shape[1]
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    function = lib.int4_linear_f32 if bits == 4 else lib.uint8_linear_f32
    rc = function(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                  None if bias is None else bias.data_ptr(), n, k, group, y.data_ptr(), n,
                  torch.get_num_threads() if num_threads is None else num_threads)
    if rc:
        raise RuntimeError(f"the {bits}-bit kernel failed ({'out of memory' if rc == 1 else 'bad shapes'})")
    return y


class _WeightArgs:
    """A layer's checked kernel arguments: the pointers of its (already float32, contiguous) tensors and
    N, K, G. Kept per ``packed`` tensor (see :func:`_weight_args`) so that a decode call's Python side
    costs little next to the kernel."""

    __slots__ = ("function", "bits", "packed", "scales", "zeros", "bias", "pointers", "n", "k", "group")

    def __init__(self, lib, bits, packed, scales, zeros, bias, group, keep_packed):
        # a cached entry must not hold its packed tensor (the cache's key) alive
        self.function = lib.int4_linear_f32 if bits == 4 else lib.uint8_linear_f32
        self.bits, self.scales, self.zeros, self.bias = bits, scales, zeros, bias
        self.packed = packed if keep_packed else None
        self.n, self.k, self.group = packed.shape[0], packed.shape[1] * (2 if bits == 4 else 1), group
        self.pointers = (packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                         None if bias is None else bias.data_ptr(), self.n, self.k, group)


# id(packed) -> (weak reference to packed, its _WeightArgs); an entry goes when its packed tensor does.
# Only tensors the kernel reads as they are (no converted copy that could go stale) are kept.
_CACHE: dict[int, tuple[weakref.ref, _WeightArgs]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _CACHE.get(key)
    if entry is not None and entry[0] is ref:
        del _CACHE[key]


def _check_weight(packed, scales, zeros, bias, bits) -> int | None:
    """The group size, or None where the kernel does not take these weights."""
    if packed.dtype is not torch.uint8 or packed.dim() != 2 or not packed.is_cpu:
        return None
    n, k = packed.shape[0], packed.shape[1] * (2 if bits == 4 else 1)
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 or k % scales.shape[1]:
        return None
    if tuple(zeros.shape) != tuple(scales.shape) or not supported_shape(k, k // scales.shape[1]):
        return None
    if not (scales.is_cpu and zeros.is_cpu) or (bias is not None and (not bias.is_cpu or tuple(bias.shape) != (n,))):
        return None
    return k // scales.shape[1]


def _weight_args(packed, scales, zeros, bias, bits) -> _WeightArgs | None:
    entry = _CACHE.get(id(packed))
    if entry is not None:
        args = entry[1]
        if (entry[0]() is packed and args.scales is scales and args.zeros is zeros and args.bias is bias
                and args.bits == bits):
            return args
    group = _check_weight(packed, scales, zeros, bias, bits)
    if group is None:
        return None
    lib = _library()
    if lib is None:
        return None
    as_is = [t is None or (t.dtype is torch.float32 and t.is_contiguous()) for t in (scales, zeros, bias)]
    as_is = all(as_is) and packed.is_contiguous()
    c_packed = packed.contiguous()
    c_scales, c_zeros = scales.to(torch.float32).contiguous(), zeros.to(torch.float32).contiguous()
    c_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    args = _WeightArgs(lib, bits, c_packed, c_scales, c_zeros, c_bias, group, keep_packed=not as_is)
    if as_is:
        key = id(packed)
        _CACHE[key] = (weakref.ref(packed, lambda ref, key=key: _forget(key, ref)), args)
    return args


def _linear(x, packed, scales, zeros, bias, bits) -> torch.Tensor | None:
    if x.dtype is not torch.float32 or x.dim() != 2 or not x.is_cpu:
        return None
    args = _weight_args(packed, scales, zeros, bias, bits)
    if args is None or x.shape[1] != args.k:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], args.n, dtype=torch.float32)
    if args.function(x.data_ptr(), x.stride(0), x.shape[0], *args.pointers, y.data_ptr(), args.n,
                     torch.get_num_threads()):
        raise RuntimeError(f"the {bits}-bit kernel ran out of memory")
    return y


def int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ W.T + bias`` by the C kernel: ``x`` float32 [M, K] on CPU, ``packed`` uint8 [N, K // 2],
    ``scales`` / ``zeros`` [N, K // G], ``bias`` [N] or None; [M, N] float32, or None where the kernel
    cannot run (see the module doc)."""
    return _linear(x, packed, scales, zeros, bias, 4)


def uint8_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The same for 8-bit weights: ``packed`` uint8 [N, K], values 0..255 (``GroupQuantLinear`` with
    ``bits=8``); None where the kernel cannot run."""
    return _linear(x, packed, scales, zeros, bias, 8)

"""Causal attention of prefill chunks without a cached prefix, in C with AVX512-BF16 (``csrc/prefill_attention.c``).

Used by the CPU attention backend under ``kv_cache_dtype="bfloat16"`` with float32 activations (``dtype="bfloat16"``
on CPUs without AMX tiles), where torch's flash SDPA multiplies in float32: on two Zen 4 cores it took 5-8 ms per
layer for 16 x 128 tokens and 9 heads, 10-13% of a 2,048-token prefill step; the kernel takes 2.7-3.1 ms. It reads
the chunk's own new keys and values rounded to bf16 as the cache holds them and keeps the query, the scores, the
softmax and the weighted sum in float32: the outputs equal float32 SDPA over the bf16 cache to about 1e-6.
``ASYNCLLM_CPU_PREFILL_ATTENTION=0`` keeps SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from .cpu_build import load_library

ENV_SWITCH = "ASYNCLLM_CPU_PREFILL_ATTENTION"
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = (
    ("prefill_attention", (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, ctypes.c_int, _ptr, _i64, _i64,
                           _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int), ctypes.c_int),
    ("prefill_attention_bf16", (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                _ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int), ctypes.c_int),
    ("prefill_attention_supported", (), ctypes.c_int),
)


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_library("prefill_attention", _SIGNATURES)


@functools.cache
def available() -> bool:
    """Whether the kernel was built with AVX512-BF16 here and is not switched off."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    lib = _library()
    return lib is not None and bool(lib.prefill_attention_supported())


def shape_supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    """The shapes the kernel takes: head_dim a multiple of 32, query heads a multiple of KV heads."""
    return head_dim > 0 and head_dim % 32 == 0 and kv_heads > 0 and heads % kv_heads == 0


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                      starts: torch.Tensor, lengths: torch.Tensor, scale: float) -> None:
    """Causal attention of each sequence's rows ``starts[s] .. starts[s] + lengths[s] - 1`` to themselves, into ``out``.

    query/out: [tokens, heads, head_dim], both float32 (keys and values float32, rounded to bf16 here, or bfloat16;
    the query keeps its float32 precision) or both bfloat16 (keys and values bfloat16; the numbers of torch's bf16
    SDPA); key/value: [tokens, kv_heads, head_dim]; each with a contiguous last dimension; starts/lengths: int64 [n]."""
    lib = _library()
    if lib is None or not available():
        raise RuntimeError("the CPU prefill attention kernel is not available on this machine")
    if query.dtype not in (torch.float32, torch.bfloat16) or out.dtype != query.dtype:
        raise TypeError(f"query and out must both be float32 or bfloat16, got {query.dtype} and {out.dtype}")
    for name, t in (("query", query), ("out", out)):
        if t.device.type != "cpu" or t.dim() != 3 or t.stride(-1) != 1:
            raise TypeError(f"{name} must be a CPU tensor [tokens, heads, head_dim] with a contiguous last dim")
    if key.dtype != value.dtype or key.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"key and value must both be float32 or bfloat16, got {key.dtype} and {value.dtype}")
    bf16 = query.dtype == torch.bfloat16
    if bf16 and key.dtype != torch.bfloat16:
        raise TypeError(f"a bfloat16 query needs bfloat16 keys and values, got {key.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.device.type != "cpu" or t.dim() != 3 or t.stride(-1) != 1:
            raise TypeError(f"{name} must be a CPU tensor [tokens, kv_heads, head_dim] with a contiguous last dim")
    for name, t in (("starts", starts), ("lengths", lengths)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.dim() != 1:
            raise TypeError(f"{name} must be a contiguous 1-d int64 tensor")
    if starts.numel() != lengths.numel():
        raise ValueError("starts and lengths must have one entry per sequence")
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    if not shape_supported(heads, kv_heads, dim) or key.shape != value.shape or key.shape[2] != dim:
        raise ValueError(f"unsupported attention shape: {heads} heads, {kv_heads} KV heads, head_dim {dim}")
    if starts.numel() and int((starts + lengths).max()) > min(tokens, key.shape[0], out.shape[0]):
        raise ValueError("a sequence's rows run past the tensors' rows")
    if bf16:
        failed = lib.prefill_attention_bf16(
            query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0), key.stride(1),
            value.data_ptr(), value.stride(0), value.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            starts.data_ptr(), lengths.data_ptr(), starts.numel(), heads, kv_heads, dim, scale, torch.get_num_threads())
    else:
        failed = lib.prefill_attention(
            query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0), key.stride(1),
            value.data_ptr(), value.stride(0), value.stride(1), int(key.dtype == torch.bfloat16), out.data_ptr(),
            out.stride(0), out.stride(1), starts.data_ptr(), lengths.data_ptr(), starts.numel(), heads, kv_heads,
            dim, scale, torch.get_num_threads())
    if failed == 1:
        raise MemoryError("the CPU prefill attention kernel could not allocate its scratch memory")
    if failed:
        raise RuntimeError(f"the CPU prefill attention kernel refused its arguments (code {failed})")

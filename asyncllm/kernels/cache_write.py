"""Triton KV-cache write: each new token's keys and values go to its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import next_power_of_2


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ELEMENTS: tl.constexpr, ELEMENTS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A negative slot is padding (a CUDA-graph batch filled up to its bucket): nothing to store.
    if slot >= 0:
        e = tl.arange(0, ELEMENTS_PAD)
        ok = e < ELEMENTS
        head = e // HEAD_DIM
        dim = e % HEAD_DIM
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=ok)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=ok)
        tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + dim, k, mask=ok)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + dim, v, mask=ok)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store key/value ([tokens, kv_heads, head_dim], any token/head strides, last dim contiguous)
    into caches [blocks, block_size, kv_heads, head_dim] at ``slot_mapping`` (negative: skip)."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    _, block_size, kv_heads, head_dim = k_cache.shape
    elements = kv_heads * head_dim
    _write_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, ELEMENTS=elements, ELEMENTS_PAD=next_power_of_2(elements),
        num_warps=4 if elements <= 2048 else 8)

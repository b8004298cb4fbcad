"""The fused Triton elementwise kernels (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul)
equal the torch versions they replace, on the strided views the model hands them."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import ops
from kernel_cases import DEVICE, INTERPRET

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding step of the model dtype: the kernels round where torch does, but intermediate
# float32 values may differ in the last bit (fused multiply-adds, summation order).
ULP = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def both(fn, *args):
    """fn(*args) through torch, then through the Triton kernels (on copies: rotary is in place)."""
    expected = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    with ops.triton_ops():
        assert ops.use_triton(args[0])
        got = fn(*args)
    return got, expected


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


def assert_close(got, expected, dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=ULP[dtype] * 4, rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_rows_and_on_head_views(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 96, generator=gen) * 3).to(dtype).to(DEVICE)  # 96: not a power of two
    weight = torch.randn(96, generator=gen).to(dtype).to(DEVICE)
    assert_close(*both(ops.rms_norm, x, weight, 1e-6), dtype)
    q, _ = qkv_views(3, 4, 2, 32, dtype)  # Qwen3's per-head q norm reads a strided view
    head_weight = torch.randn(32, generator=gen).to(dtype).to(DEVICE)
    assert_close(*both(ops.rms_norm, q, head_weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_sum_and_norm(dtype):
    gen = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(2, 7, 64, generator=gen).to(dtype).to(DEVICE))
    weight = torch.randn(64, generator=gen).to(dtype).to(DEVICE)
    (total, normed), (total_ref, normed_ref) = both(ops.add_rms_norm, x, residual, weight, 1e-5)
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter truncates to bf16 instead of rounding
        assert_close(total, total_ref, dtype)
    else:  # one rounding of the same float32 sum: bit-identical
        assert torch.equal(total, total_ref)
    assert_close(normed, normed_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 128])
def test_rotary_on_qkv_views(dtype, head_dim):
    from asyncllm.model.rotary import RotaryEmbedding

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rotary = RotaryEmbedding(inv_freq, 1.0, 64)
    rotary.build(DEVICE, dtype)
    q, k = qkv_views(6, 4, 2, head_dim, dtype)
    positions = torch.tensor([0, 1, 5, 17, 40, 63], device=DEVICE)
    (q_got, k_got), (q_ref, k_ref) = both(rotary, positions, q, k)
    assert q_got.data_ptr() == q.data_ptr()  # rotated in place
    assert_close(q_got, q_ref, dtype)
    assert_close(k_got, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_gate_up_halves(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(4, 2 * 1100, generator=gen) * 2).to(dtype).to(DEVICE)  # > one 1024 block
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(*both(ops.silu_and_mul, gate, up), dtype)


def test_torch_path_outside_the_context():
    x = torch.randn(2, 8, device=DEVICE)
    assert not ops.use_triton(x)
    with ops.triton_ops(False):
        assert not ops.use_triton(x)

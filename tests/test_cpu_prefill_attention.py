"""The C prefill attention kernel (AVX512-BF16) for chunks without a cached prefix over a bf16 KV cache.

Oracle: float32 SDPA (causal, grouped heads) over keys and values rounded to bf16 as the cache holds them, with the
float32 query: the kernel must agree within 3e-5 on every row, whatever the heads, head size, lengths, strides and
row order; bf16 keys and values in give exactly what float32 ones rounded here give. Inside the CPU backend, it
must run for the step's own-rows chunks and leave the chunks with a prefix and the decodes to the other paths."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from asyncllm.kernels import cpu_attention, cpu_prefill_attention as pa
from kernel_cases import DEVICE, build_variant_or_skip, paged_batch, reference_attention

pytestmark = [
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                       reason="no C compiler to build the CPU kernels"),
    pytest.mark.skipif(DEVICE.type != "cpu", reason="a CPU kernel"),
    pytest.mark.skipif(not pa.available(), reason="this CPU has no AVX512-BF16 (the #else build is tested below)"),
]


def _reference(q, k, v, starts, lengths, scale):
    out = torch.zeros_like(q)
    kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    for s, n in zip(starts.tolist(), lengths.tolist()):
        qq, kk, vv = (t[s:s + n].transpose(0, 1)[None] for t in (q, kb, vb))
        group = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        out[s:s + n] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


def _fused_qkv(tokens, heads, kv_heads, dim, seed):
    """q, k, v as strided views of one fused qkv tensor, as the model's projection makes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


@pytest.mark.parametrize("heads,kv_heads,dim,lengths", [
    pytest.param(9, 3, 64, [128] * 6, id="smollm2-gqa3"),
    pytest.param(4, 4, 32, [1, 2, 3, 4, 5, 17, 63, 64, 65, 130], id="mha-d32-odd-lengths"),
    pytest.param(8, 2, 128, [300], id="gqa4-d128-long"),
    pytest.param(6, 1, 96, [5, 100], id="mqa-d96"),
])
def test_kernel_equals_float32_sdpa_over_the_bf16_cache(heads, kv_heads, dim, lengths):
    tokens = sum(lengths) + len(lengths) + 4
    q, k, v = _fused_qkv(tokens, heads, kv_heads, dim, seed=len(lengths))
    order = list(reversed(range(len(lengths))))  # sequences laid out back to front, with gaps between them
    starts, at = [0] * len(lengths), 3
    for i in order:
        starts[i], at = at, at + lengths[i] + (1 if i % 2 else 0)
    starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
    out = torch.full_like(q, float("nan"))
    pa.prefill_attention(q, k, v, out, starts_t, lengths_t, dim ** -0.5)
    ref = _reference(q, k, v, starts_t, lengths_t, dim ** -0.5)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    torch.testing.assert_close(out[rows], ref[rows], atol=3e-5, rtol=3e-5)
    others = torch.ones(tokens, dtype=torch.bool)
    others[rows] = False
    assert torch.isnan(out[others]).all()  # rows outside the sequences are not written
    # bf16 keys and values in: the same bits as float32 ones rounded by the kernel
    again = torch.empty_like(q)
    pa.prefill_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), again, starts_t, lengths_t, dim ** -0.5)
    assert torch.equal(again[rows], out[rows])


def test_kernel_keeps_the_float32_query_precision():
    """Rounding the query to bf16 would move the outputs by ~1e-3 here; the kernel keeps it float32 (within 3e-5)."""
    q, k, v = _fused_qkv(200, 4, 2, 64, seed=5)
    starts, lengths = torch.tensor([0]), torch.tensor([200])
    out = torch.empty_like(q)
    pa.prefill_attention(q, k, v, out, starts, lengths, 0.125)
    exact = _reference(q, k, v, starts, lengths, 0.125)
    rounded = _reference(q.to(torch.bfloat16).float(), k, v, starts, lengths, 0.125)
    assert (rounded - exact).abs().max() > 1e-3
    assert (out - exact).abs().max() < 3e-5


def test_kernel_refuses_what_it_does_not_take():
    q, k, v = _fused_qkv(16, 4, 2, 64, seed=1)
    out, starts, lengths = torch.empty_like(q), torch.tensor([0]), torch.tensor([16])
    with pytest.raises(ValueError, match="head_dim 48"):
        q48 = torch.randn(16, 4, 48)
        pa.prefill_attention(q48, torch.randn(16, 2, 48), torch.randn(16, 2, 48), torch.empty_like(q48), starts,
                             lengths, 0.1)
    with pytest.raises(ValueError, match="run past"):
        pa.prefill_attention(q, k, v, out, starts, torch.tensor([17]), 0.1)
    with pytest.raises(TypeError, match="query must be a float32"):
        pa.prefill_attention(q.to(torch.bfloat16), k, v, out, starts, lengths, 0.1)
    with pytest.raises(TypeError, match="key and value"):
        pa.prefill_attention(q, k.half(), v.half(), out, starts, lengths, 0.1)
    with pytest.raises(TypeError, match="starts"):
        pa.prefill_attention(q, k, v, out, starts.int(), lengths, 0.1)
    assert not pa.shape_supported(9, 2, 64) and not pa.shape_supported(8, 2, 40) and pa.shape_supported(9, 3, 64)


# own-rows prefill chunks (two of one shape: a group, and one single), chunks with a prefix, and decodes
STEP = [(0, 40), (0, 40), (0, 7), (37, 1), (16, 9), (70, 1), (5, 5)]


def test_backend_runs_the_kernel_for_own_rows_chunks_only(monkeypatch):
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: False)
    calls = []
    real = pa.prefill_attention

    def spy(query, key, value, out, starts, lengths, scale):
        calls.append((starts.tolist(), lengths.tolist()))
        return real(query, key, value, out, starts, lengths, scale)

    monkeypatch.setattr(pa, "prefill_attention", spy)
    batch = paged_batch(STEP, 8, 2, 64, 16, torch.float32, seed=4)
    backend = cpu_attention.CpuAttentionBackend()
    meta = batch.meta()
    backend.prepare(meta)
    k_cache, v_cache = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    out = backend.forward(batch.query, k_cache, v_cache, meta, 0.125)
    # the three own-rows chunks (rows 0-39, 40-79, 80-86), in one call; not the chunks with a prefix
    assert len(calls) == 1 and sorted(zip(*calls[0])) == [(0, 40), (40, 40), (80, 7)]
    ref = reference_attention(batch, k_cache.float(), v_cache.float(), 0.125)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    # switched off: SDPA for every prefill chunk, the same numbers within the tolerance
    monkeypatch.setattr(pa, "available", lambda: False)
    calls.clear()
    meta = batch.meta()
    backend.prepare(meta)
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    plain = backend.forward(batch.query, k_cache, v_cache, meta, 0.125)
    assert not calls
    torch.testing.assert_close(plain, out, atol=3e-5, rtol=3e-5)


def test_backend_leaves_a_float32_cache_to_sdpa(monkeypatch):
    """Over a float32 cache attention stays exact float32: the kernel, which rounds keys to bf16, must not run."""
    monkeypatch.setattr(pa, "prefill_attention", lambda *a: pytest.fail("kernel ran over a float32 cache"))
    batch = paged_batch(STEP, 8, 2, 64, 16, torch.float32, seed=4)
    backend = cpu_attention.CpuAttentionBackend()
    meta = batch.meta()
    backend.prepare(meta)
    backend.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, meta)
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, meta, 0.125)
    torch.testing.assert_close(out, reference_attention(batch, batch.k_cache, batch.v_cache, 0.125),
                               atol=2e-5, rtol=2e-5)


def test_build_without_avx512_bf16_reports_unsupported(tmp_path):
    lib = build_variant_or_skip("prefill_attention", ["-mno-avx512bf16"], tmp_path / "pa_noavx512bf16.so",
                                pa._SIGNATURES)
    assert lib.prefill_attention_supported() == 0
    q, k, v = _fused_qkv(4, 4, 2, 64, seed=2)
    out, starts, lengths = torch.empty_like(q), torch.tensor([0]), torch.tensor([4])
    code = lib.prefill_attention(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                                 v.data_ptr(), v.stride(0), v.stride(1), 0, out.data_ptr(), out.stride(0),
                                 out.stride(1), starts.data_ptr(), lengths.data_ptr(), 1, 4, 2, 64, 0.125, 1)
    assert code == 3  # the caller then keeps SDPA (available() is False for such a build)

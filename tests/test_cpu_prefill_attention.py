"""The C prefill attention kernel (AVX512-BF16) for chunks without a cached prefix over a bf16 KV cache.

Oracle: float32 SDPA (causal, grouped heads) over keys and values rounded to bf16 as the cache holds them, with the
float32 query: the kernel must agree within 3e-5 on every row, whatever the heads, head size, lengths, strides and
row order; bf16 keys and values in give exactly what float32 ones rounded here give. Its bf16 variant (bf16 query
and output) is checked against torch's bf16 SDPA computation written out step by step (float32 scores of the bf16
values, float32 softmax, probabilities rounded to bf16, output rounded to bf16). Inside the CPU backend, it must run
for the step's own-rows chunks and leave the chunks with a prefix and the decodes to the other paths."""

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


# heads, KV heads, head size and sequence lengths the kernels are checked on
SHAPES = [
    pytest.param(9, 3, 64, [128] * 6, id="smollm2-gqa3"),
    pytest.param(4, 4, 32, [1, 2, 3, 4, 5, 17, 63, 64, 65, 130], id="mha-d32-odd-lengths"),
    pytest.param(8, 2, 128, [300], id="gqa4-d128-long"),
    pytest.param(6, 1, 96, [5, 100], id="mqa-d96"),
]


def _fused_qkv(tokens, heads, kv_heads, dim, seed):
    """q, k, v as strided views of one fused qkv tensor, as the model's projection makes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


@pytest.mark.parametrize("heads,kv_heads,dim,lengths", SHAPES)
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


def _bf16_sdpa_steps(q, k, v, starts, lengths, scale):
    """torch's bf16 flash SDPA on CPU, step by step: float32 scores and softmax of the bf16 values, the probabilities
    rounded to bf16 for the weighted sum, their float32 total dividing it, the output rounded to bf16."""
    out = torch.zeros_like(q)
    for s, n in zip(starts.tolist(), lengths.tolist()):
        qq, kk, vv = (t[s:s + n].float().transpose(0, 1) for t in (q, k, v))
        group = qq.shape[0] // kk.shape[0]
        kk, vv = kk.repeat_interleave(group, dim=0), vv.repeat_interleave(group, dim=0)
        scores = (qq @ kk.transpose(1, 2)) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weighted = e.to(torch.bfloat16).float() @ vv
        out[s:s + n] = (weighted / e.sum(dim=-1, keepdim=True)).transpose(0, 1).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("heads,kv_heads,dim,lengths", SHAPES)
def test_bf16_kernel_computes_what_bf16_sdpa_computes(heads, kv_heads, dim, lengths):
    tokens = sum(lengths) + 3
    q, k, v = (t.to(torch.bfloat16) for t in _fused_qkv(tokens, heads, kv_heads, dim, seed=7 + len(lengths)))
    starts, at = [], 3
    for n in lengths:
        starts.append(at)
        at += n
    starts_t, lengths_t = torch.tensor(starts), torch.tensor(lengths)
    out = torch.full_like(q, float("nan"))
    pa.prefill_attention(q, k, v, out, starts_t, lengths_t, dim ** -0.5)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert torch.isnan(out[:3]).all()  # rows outside the sequences are not written
    want = _bf16_sdpa_steps(q, k, v, starts_t, lengths_t, dim ** -0.5)[rows].float()
    got = out[rows].float()
    # the same numbers up to float32 summation order and exp's last bit: nearly always equal; where a probability
    # rounds to the other bf16 neighbour (one step of 2^-8 of it), its value's share moves by that much
    assert (got == want).float().mean() > 0.97
    torch.testing.assert_close(got, want, atol=2.0 ** -8 * 8, rtol=2.0 ** -7)
    # and as far from exact float32 attention as torch's own bf16 SDPA is
    exact = _reference(q.float(), k.float(), v.float(), starts_t, lengths_t, dim ** -0.5)[rows]
    torch_bf16 = torch.zeros_like(q)
    for s, n in zip(starts, lengths):
        qq, kk, vv = (t[s:s + n].transpose(0, 1)[None] for t in (q, k, v))
        kk, vv = kk.repeat_interleave(heads // kv_heads, dim=1), vv.repeat_interleave(heads // kv_heads, dim=1)
        torch_bf16[s:s + n] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=dim ** -0.5)[0].transpose(0, 1)
    assert (got - exact).abs().max() <= 1.5 * (torch_bf16[rows].float() - exact).abs().max()


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
    with pytest.raises(TypeError, match="query and out must both be float32 or bfloat16"):
        pa.prefill_attention(q.to(torch.bfloat16), k, v, out, starts, lengths, 0.1)
    with pytest.raises(TypeError, match="bfloat16 query needs bfloat16 keys"):
        pa.prefill_attention(q.to(torch.bfloat16), k, v, out.to(torch.bfloat16), starts, lengths, 0.1)
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


def test_backend_runs_the_bf16_kernel_for_a_bf16_query(monkeypatch):
    """A prefill-only step whose layers keep q, k, v bf16 (model/decoder.py): the bf16 kernel for its own-rows chunks,
    bf16 SDPA for the rest, the numbers of bf16 attention throughout."""
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: False)
    step = [(0, 40), (0, 40), (0, 7), (16, 9), (5, 5)]  # no decodes: a prefill-only step
    batch = paged_batch(step, 8, 2, 64, 16, torch.float32, seed=6)
    backend = cpu_attention.CpuAttentionBackend()
    meta = batch.meta()
    backend.prepare(meta)
    k_cache, v_cache = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    query, key, value = (t.to(torch.bfloat16) for t in (batch.query, batch.key, batch.value))
    backend.write_kv(key, value, k_cache, v_cache, meta)
    calls = []
    real = pa.prefill_attention
    monkeypatch.setattr(pa, "prefill_attention", lambda q, *a: (calls.append(q.dtype), real(q, *a))[1])
    out = backend.forward(query, k_cache, v_cache, meta, 0.125)
    assert calls == [torch.bfloat16] and out.dtype == torch.bfloat16
    ref = reference_attention(batch, k_cache.float(), v_cache.float(), 0.125)  # float32, the query exact
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


def test_bf16_layers_only_where_every_chunk_attends_to_itself(monkeypatch):
    """Without AMX a prefill-only step keeps its layers bf16 only when the C kernel takes all its chunks (a chunk
    with a cached prefix would go to bf16 SDPA, no faster there than float32); ASYNCLLM_BF16_ATTENTION=0 keeps the
    float32 query everywhere; AMX (bf16 SDPA) always."""
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: False)
    backend = cpu_attention.CpuAttentionBackend()
    hidden, cache = torch.zeros(1, 4), torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)

    def decided(step, hidden=hidden, cache=cache):
        meta = paged_batch(step, 8, 2, 64, 16, torch.float32, seed=1).meta()
        backend.prepare(meta)
        return backend.bf16_prefill_layers(hidden, cache, meta)

    assert decided([(0, 40), (0, 7)])
    assert not decided([(0, 40), (16, 9)])  # a cached prefix
    assert not decided([(0, 40)], cache=cache.float())  # a float32 cache stays exact
    assert not decided([(0, 40)], hidden=hidden.to(torch.bfloat16))
    monkeypatch.setenv("ASYNCLLM_BF16_ATTENTION", "0")
    assert not decided([(0, 40), (0, 7)])
    monkeypatch.delenv("ASYNCLLM_BF16_ATTENTION")
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: True)
    assert decided([(0, 40), (16, 9)])


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

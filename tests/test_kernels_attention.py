"""The Triton paged-attention kernels equal the torch reference (interpreter on CPU, or CUDA).

Every batch is ragged and its block tables are scattered over the pool. The sequence mixes cover
decodes, fresh prefills, chunked prefills (a later chunk of a prompt: cached tokens plus several
new ones) and prefix-cache hits (a fresh prompt whose first full blocks are already cached).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncllm.kernels.triton_attention import AttentionTuning, TritonAttentionBackend
from kernel_cases import DEVICE, TOLERANCE, paged_batch, reference_attention

# (cached, new) per sequence
MIXED = [(0, 1), (37, 1), (0, 23), (13, 9), (8, 5), (70, 1)]   # decode, prefill, chunk, prefix hit of 2 blocks
# Small tiles and a pretend 4-SM device: multi-tile loops and split-KV at these tiny lengths.
SMALL = AttentionTuning(tile_n=16, prefill_block_m=16, min_split_tokens=8, num_sms=4)

CASES = [
    # heads, kv_heads, head_dim, block_size, dtype
    pytest.param(4, 2, 32, 4, torch.float32, id="gqa2-d32-bs4-f32"),
    pytest.param(8, 1, 64, 16, torch.float16, id="mqa8-d64-bs16-f16"),
    pytest.param(8, 2, 128, 32, torch.bfloat16, id="gqa4-d128-bs32-bf16"),
    pytest.param(6, 2, 64, 16, torch.float32, id="gqa3-d64-bs16-f32"),
]


def run_triton(batch, tuning=SMALL, static_max_len: int | None = None):
    heads, kv_heads = batch.query.shape[1], batch.k_cache.shape[2]
    backend = TritonAttentionBackend(heads, kv_heads, tuning)
    meta = batch.meta()
    if static_max_len is None:
        backend.prepare(meta)
    else:
        backend.prepare_static(meta, static_max_len)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    scale = batch.query.shape[-1] ** -0.5
    return backend.forward(batch.query, k_cache, v_cache, meta, scale), k_cache, v_cache, meta


def expected_caches(batch):
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = torch.tensor(batch.slots, device=DEVICE)
    k_cache.flatten(0, 1).index_copy_(0, slots, batch.key)
    v_cache.flatten(0, 1).index_copy_(0, slots, batch.value)
    return k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", CASES)
def test_mixed_batch_equals_reference(heads, kv_heads, head_dim, block_size, dtype):
    batch = paged_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype)
    out, k_cache, v_cache, meta = run_triton(batch)
    assert [launch.num_splits > 1 for launch in meta.backend_state.launches] == [True, False]
    k_ref, v_ref = expected_caches(batch)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    ref = reference_attention(batch, k_cache, v_cache, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("tuning", [SMALL, AttentionTuning(min_split_tokens=16, num_sms=1)],
                         ids=["splits-small-tiles", "one-split-default-tiles"])
def test_long_decodes_with_and_without_split(tuning):
    """Flash-decoding: long contexts at batch 2, split over many programs (or not) and merged."""
    batch = paged_batch([(300, 1), (45, 1)], 4, 2, 32, 16, torch.float16, seed=1)
    out, k_cache, v_cache, meta = run_triton(batch, tuning)
    splits = meta.backend_state.launches[0].num_splits
    assert (splits > 1) == (tuning is SMALL)
    ref = reference_attention(batch, k_cache, v_cache, 32 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


def test_static_plan_with_padding_rows():
    """The CUDA-graph plan: launch shape from the batch size alone; padding rows (slot -1,
    length 0) write nothing and read nothing, whatever their block tables say."""
    specs = [(20, 1), (3, 1), (0, 1), (0, 1)]
    batch = paged_batch(specs, 4, 2, 32, 4, torch.float32, seed=2)
    batch.slots[2:] = [-1, -1]
    batch.specs[2:] = [(-1, 1), (-1, 1)]  # seq_len 0: padding
    out, k_cache, v_cache, meta = run_triton(batch, static_max_len=256)
    assert meta.backend_state.launches[0].num_splits > 1
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    real = torch.tensor(batch.slots[:2], device=DEVICE)
    expected_k.flatten(0, 1).index_copy_(0, real, batch.key[:2])
    expected_v.flatten(0, 1).index_copy_(0, real, batch.value[:2])
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    real_batch = replace(batch, specs=specs[:2], query=batch.query[:2], block_tables=batch.block_tables[:2])
    ref = reference_attention(real_batch, k_cache, v_cache, 32 ** -0.5)
    torch.testing.assert_close(out[:2], ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (12, 1.5)],
                         ids=["window5", "softcap2", "window12-softcap1.5"])
@pytest.mark.parametrize("tuning", [SMALL, AttentionTuning(min_split_tokens=16, num_sms=1)],
                         ids=["splits-small-tiles", "one-split"])
def test_sliding_window_and_soft_cap_equal_the_reference(window, softcap, tuning):
    """Gemma 2's attention variants in the kernel: a window shorter than most sequences (decodes,
    prefills, chunks and prefix hits, split or not) and tanh-capped scores, against the reference."""
    from asyncllm.kernels.torch_attention import windowed_attention

    batch = paged_batch(MIXED + [(300, 1)], 4, 2, 32, 4, torch.float32, seed=3)
    heads, kv_heads = batch.query.shape[1], batch.k_cache.shape[2]
    backend = TritonAttentionBackend(heads, kv_heads, tuning)
    meta = batch.meta()
    backend.prepare(meta)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    scale = 32 ** -0.5
    query = batch.query * 4  # large scores, so the cap bites
    out = backend.forward(query, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    ref = windowed_attention(query.float(), k_cache.float(), v_cache.float(), batch.meta(), scale, window, softcap)
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=1e-4)
    plain = backend.forward(query, k_cache, v_cache, meta, scale)
    assert not torch.allclose(plain, out, atol=1e-3)  # the variant changed the result

"""kv_cache_dtype="bfloat16" on CPU: the cache holds bf16-rounded keys and values under float32 activations.

Oracles: the C decode kernel over a bf16 cache equals the torch reference over the same cache widened to float32
(the rounding happens once, at the write, identically on both paths); the decode stack equals the module path on
a bf16 cache; an engine with a bf16 cache holds half the bytes per block, agrees with the float32 cache within
bf16's rounding, and refuses the combinations it cannot run by naming the field."""

from __future__ import annotations

import shutil

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.kernels.cpu_attention import CpuAttentionBackend, paged_decode
from kernel_cases import DEVICE, paged_batch, reference_attention
from test_decode_stack import _compare, _prompts

pytestmark = [
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                       reason="no C compiler to build the CPU kernels"),
    pytest.mark.skipif(DEVICE.type != "cpu", reason="kernel_cases builds CUDA batches on a GPU machine"),
]

MIXED = [(0, 1), (37, 1), (0, 23), (15, 1), (16, 1), (13, 9), (70, 1), (200, 1)]


def _bf16_backend_run(batch):
    """The CPU backend over a bf16 copy of the batch's cache: its output and the caches after the write."""
    backend = CpuAttentionBackend()
    meta = batch.meta()
    backend.prepare(meta)
    k_cache, v_cache = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    scale = batch.query.shape[-1] ** -0.5
    return backend.forward(batch.query, k_cache, v_cache, meta, scale), k_cache, v_cache, scale


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    pytest.param(8, 2, 64, 16, id="gqa4-d64-bs16"),   # the unrolled AVX-512 copy
    pytest.param(8, 1, 128, 16, id="mqa-d128-bs16"),
    pytest.param(6, 2, 48, 8, id="gqa3-d48-bs8"),     # no unrolled copy for 48
    pytest.param(4, 2, 40, 8, id="gqa2-d40-bs8"),     # not a multiple of 16: the portable loops
])
def test_bf16_cache_equals_reference_over_the_widened_cache(heads, kv_heads, head_dim, block_size, monkeypatch):
    from asyncllm.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: False)  # float32 prefill SDPA (AMX CPUs: below)
    batch = paged_batch(MIXED, heads, kv_heads, head_dim, block_size, torch.float32, seed=3)
    out, k_cache, v_cache, scale = _bf16_backend_run(batch)
    assert k_cache.dtype == v_cache.dtype == torch.bfloat16
    # the write rounded the new keys to bf16 (round to nearest even, torch's conversion)
    slots = batch.meta().slot_mapping
    written = k_cache.view(-1, kv_heads, head_dim).index_select(0, slots)
    assert torch.equal(written, batch.key.to(torch.bfloat16))
    ref = reference_attention(batch, k_cache.float(), v_cache.float(), scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # and the bf16 cache is not the float32 one: the outputs differ by bf16's rounding, not more
    exact = reference_attention(batch, *_float_cache_after_write(batch), scale)
    diff = (out - exact).abs().max().item()
    assert 0 < diff < 0.05


def test_prefill_over_a_bf16_cache_attends_in_bf16_where_amx_says_so(monkeypatch):
    """On AMX CPUs (forced here) prefill SDPA over a bf16 cache runs in bf16: its rows within bf16's rounding of the
    float32 reference over the same cache; the decode rows still come from the C kernel in float32, exactly."""
    from asyncllm.kernels import cpu_attention

    batch = paged_batch(MIXED, 8, 2, 64, 16, torch.float32, seed=3)
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: True)
    out, k_cache, v_cache, scale = _bf16_backend_run(batch)
    assert CpuAttentionBackend.prefill_dtype(batch.query, k_cache) == torch.bfloat16
    assert CpuAttentionBackend.prefill_dtype(batch.query, k_cache.float()) is None  # a float32 cache: float32
    ref = reference_attention(batch, k_cache.float(), v_cache.float(), scale)
    meta = batch.meta()
    decode_rows = [meta.query_start[i] for i in meta.decode_indices]
    prefill_rows = [r for i in meta.prefill_indices for r in range(meta.query_start[i], meta.query_start[i + 1])]
    torch.testing.assert_close(out[decode_rows], ref[decode_rows], atol=2e-5, rtol=2e-5)
    diff = (out[prefill_rows] - ref[prefill_rows]).abs().max().item()
    assert 0 < diff < 0.05, diff


def _float_cache_after_write(batch):
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    CpuAttentionBackend().write_kv(batch.key, batch.value, k_cache, v_cache, batch.meta())
    return k_cache, v_cache


def test_paged_decode_checks_the_cache_dtypes():
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 4, 1, 16)
    ints = torch.zeros(1, dtype=torch.int64)
    tables = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="k_cache must be a float32 or bfloat16"):
        paged_decode(q, cache.half(), cache.half(), tables, ints + 1, ints, ints, 1.0, q.clone())
    with pytest.raises(TypeError, match="k_cache and v_cache must have one dtype"):
        paged_decode(q, cache, cache.bfloat16(), tables, ints + 1, ints, ints, 1.0, q.clone())
    with pytest.raises(TypeError, match="query must be a float32"):
        paged_decode(q.bfloat16(), cache.bfloat16(), cache.bfloat16(), tables, ints + 1, ints, ints, 1.0, q.clone())


def test_engine_with_a_bf16_cache(model_dirs):
    f32 = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    bf16 = LLM(str(model_dirs["llama"]), dtype="float32", kv_cache_dtype="bfloat16", block_size=4)
    runner, reference = bf16.engine.runner, f32.engine.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16 and reference.kv_caches[0][0].dtype == torch.float32
    assert runner.bytes_per_block * 2 == reference.bytes_per_block
    assert runner.decode_stack is not None and runner.decode_stack.kv_bf16
    # the stack (which writes and reads the bf16 cache itself) equals the module path over the same cache
    assert _compare(bf16, _prompts(3), atol=1e-4) >= 19
    # against the float32 cache: the same text within bf16's rounding of the keys and values
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = _prompts(4, seed=5)
    a, b = f32.generate(prompts, params), bf16.generate(prompts, params)
    agree = [x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0] for x, y in zip(a, b)]
    assert sum(agree) >= 3  # the first token comes from the prefill over the rounded keys
    first_a = [next(iter(o.outputs[0].logprobs[0].values())) for o in a]
    first_b = [next(iter(o.outputs[0].logprobs[0].values())) for o in b]
    assert first_a == pytest.approx(first_b, abs=0.15)  # the toy checkpoints scale their logits up (peaked)
    assert first_a != first_b  # the rounding reached the logits: the cache really is bf16
    # nothing leaked: no block is held once the requests are done
    assert bf16.engine.kv.num_used_blocks == 0


def test_the_auto_default_follows_dtype(model_dirs):
    auto = LLM(str(model_dirs["llama"]), dtype="float32")
    assert auto.engine.runner.kv_caches[0][0].dtype == torch.float32  # float32: the exact oracle, cache included
    bf16 = LLM(str(model_dirs["llama"]), dtype="bfloat16", block_size=4)
    runner = bf16.engine.runner
    if runner.bf16_weights:  # AVX-512: bf16 weights, float32 activations, and (as vLLM's CPU build) a bf16 cache
        assert runner.dtype == torch.float32 and runner.kv_caches[0][0].dtype == torch.bfloat16
        assert runner.decode_stack.kv_bf16 and runner.decode_stack.weights == "bfloat16"
        kept = LLM(str(model_dirs["llama"]), dtype="bfloat16", kv_cache_dtype="float32")
        assert kept.engine.runner.kv_caches[0][0].dtype == torch.float32
    else:  # torch in bfloat16 throughout: the cache is the activations' dtype
        assert runner.dtype == runner.kv_caches[0][0].dtype == torch.bfloat16


def test_bad_kv_cache_dtype_is_named(model_dirs):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        LLM(str(model_dirs["llama"]), kv_cache_dtype="fp8")
    # a bf16 cache needs the CPU's attention paths; the Triton backend reads the cache in the activations' dtype
    with pytest.raises(ConfigError, match="kv_cache_dtype='bfloat16'.*'triton'"):
        LLM(str(model_dirs["llama"]), dtype="float32", kv_cache_dtype="bfloat16", attention_backend="triton")

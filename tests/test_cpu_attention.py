"""The CPU attention backend (C decode kernel + SDPA prefill) equals the torch reference, and its build."""

from __future__ import annotations

import shutil
import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.kernels import cpu_build
from asyncllm.kernels.cpu_attention import CpuAttentionBackend, paged_decode
from kernel_cases import DEVICE, paged_batch, reference_attention

pytestmark = [
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                       reason="no C compiler to build the CPU kernels"),
    pytest.mark.skipif(DEVICE.type != "cpu", reason="kernel_cases builds CUDA batches on a GPU machine"),
]

# (cached, new) per sequence: decodes of many lengths (1 token, exact block multiples, long), with
# prefills and a chunked prefill mixed in.
MIXED = [(0, 1), (37, 1), (0, 23), (15, 1), (16, 1), (13, 9), (70, 1), (200, 1)]


def cpu_batch(specs, heads, kv_heads, head_dim, block_size, seed=0):
    return paged_batch(specs, heads, kv_heads, head_dim, block_size, torch.float32, seed=seed)


def run_backend(batch):
    backend = CpuAttentionBackend()
    meta = batch.meta()
    backend.prepare(meta)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    return backend.forward(batch.query, k_cache, v_cache, meta, batch.query.shape[-1] ** -0.5), k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    pytest.param(4, 4, 32, 4, id="mha-d32-bs4"),
    pytest.param(8, 2, 64, 16, id="gqa4-d64-bs16"),
    pytest.param(8, 1, 128, 16, id="mqa-d128-bs16"),
    pytest.param(6, 2, 48, 8, id="gqa3-d48-bs8"),   # no unrolled copy for 48; still the vector path
    pytest.param(4, 2, 40, 8, id="gqa2-d40-bs8"),   # not a multiple of 16: the portable loops
    # the vector scores take keys in eights and heads in threes: a group of 5 (3 + 2), blocks of 12 (8 + 4)
    pytest.param(10, 2, 64, 12, id="gqa5-d64-bs12"),
    pytest.param(4, 2, 256, 16, id="gqa2-d256-bs16"),  # over 128: the values one head at a time
])
def test_mixed_batch_equals_reference(heads, kv_heads, head_dim, block_size):
    batch = cpu_batch(MIXED, heads, kv_heads, head_dim, block_size)
    out, k_cache, v_cache = run_backend(batch)
    ref = reference_attention(batch, k_cache, v_cache, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_decodes", [1, 3, 40])  # one KV head per work item, and whole decodes per item
def test_decode_work_splits_equal_reference(num_decodes, threads):
    specs = [(5 + 11 * i % 97, 1) for i in range(num_decodes)]
    batch = cpu_batch(specs, 8, 2, 64, 16, seed=num_decodes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, k_cache, v_cache = run_backend(batch)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, reference_attention(batch, k_cache, v_cache, 0.125), atol=2e-5, rtol=2e-5)


def test_paged_decode_rejects_bad_tensors():
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    ints = torch.zeros(1, dtype=torch.int64)
    tables = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="query must be a float32"):
        paged_decode(q.double(), cache, cache, tables, ints + 1, ints, ints, 1.0, q.clone())
    with pytest.raises(TypeError, match="seq_lens must be a contiguous int64"):
        paged_decode(q, cache, cache, tables, (ints + 1).int(), ints, ints, 1.0, q.clone())
    with pytest.raises(ValueError, match="k_cache and v_cache must be contiguous"):
        paged_decode(q, cache.transpose(0, 1), cache, tables, ints + 1, ints, ints, 1.0, q.clone())


def test_build_is_cached_falls_back_to_tmp_and_reports_a_missing_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path))
    first = cpu_build.build("paged_decode")
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build("paged_decode") == first and first.stat().st_mtime_ns == mtime  # no rebuild
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # not a folder: the build falls back to the temporary directory
    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setattr(cpu_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    fallback = cpu_build.build("paged_decode")
    assert fallback.parent.parent == tmp_path / "tmp" and fallback.exists()
    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(cpu_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp2"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_build.BuildError, match="cannot run the C compiler"):
        cpu_build.build("paged_decode")


def test_engine_picks_the_cpu_backend_and_matches_the_reference(model_dirs):
    prompts = [[5, 17, 42, 99, 3] * 9, [7] * 3, list(range(20, 61))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    auto = LLM(str(model_dirs["qwen3"]), dtype="float32", block_size=4)
    assert auto.engine.runner.backend.name == "cpu"
    reference = LLM(str(model_dirs["qwen3"]), dtype="float32", block_size=4, attention_backend="torch")
    # the reference is plain torch all through: no packed weights, no fused sampling
    assert not reference.engine.runner.cpu_fast_path and auto.engine.runner.cpu_fast_path
    from asyncllm.kernels.cpu_linear import PackedLinear

    down = reference.engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, torch.nn.Linear) and not isinstance(down, PackedLinear)  # the layer as loaded
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in reference.generate(prompts, params)]


def test_cpu_backend_errors_name_the_problem(model_dirs, monkeypatch):
    from asyncllm.kernels.cpu_decode_stack import panels_supported

    with pytest.raises(ConfigError, match="runs float32 on the CPU"):
        LLM(str(model_dirs["llama"]), dtype="float16", attention_backend="cpu")
    # bfloat16: float32 arithmetic on bf16 weights through the C kernels where the build reads bf16 panels
    # (tests/test_cpu_bf16.py), else torch in bfloat16
    expected = "cpu" if panels_supported() else "torch"
    assert LLM(str(model_dirs["llama"]), dtype="bfloat16").engine.runner.backend.name == expected
    monkeypatch.setenv(cpu_build.ENV_SWITCH, "0")
    cpu_build.load_library.cache_clear()
    try:
        assert LLM(str(model_dirs["llama"]), dtype="float32").engine.runner.backend.name == "torch"
        with pytest.raises(ConfigError, match="needs a C compiler"):
            LLM(str(model_dirs["llama"]), dtype="float32", attention_backend="cpu")
    finally:
        monkeypatch.delenv(cpu_build.ENV_SWITCH)
        cpu_build.load_library.cache_clear()


def test_paged_decode_refuses_a_length_its_table_does_not_cover():
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(4, 4, 1, 8)
    tables = torch.zeros(1, 2, dtype=torch.int64)  # 2 blocks of 4: at most 8 tokens
    rows = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_decode(q, cache, cache, tables, torch.tensor([9]), rows, rows, 1.0, q.clone())


def test_same_shape_prefill_chunks_in_one_call_equal_one_call_each():
    """Chunks behind one cached prefix (and fresh prompts of one length) are batched per shape."""
    from asyncllm.kernels.torch_attention import TorchAttentionBackend

    specs = [(16, 8), (16, 8), (16, 8), (0, 5), (0, 5), (7, 3), (30, 1)]
    batch = cpu_batch(specs, 8, 2, 32, 4, seed=3)
    meta = batch.meta()
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    plan = meta.backend_state.prefills
    assert sorted((g.num_seqs, g.q_len, g.seq_len) for g in plan.groups) == [(2, 5, 5), (3, 8, 24)]
    assert plan.singles == [5]
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    grouped = backend.forward(batch.query, k_cache, v_cache, meta, 32 ** -0.5)
    one_by_one = torch.zeros_like(grouped)
    for i in meta.prefill_indices:
        backend._prefill(i, batch.query, k_cache, v_cache, meta, 32 ** -0.5, one_by_one)
    prefill_rows = [r for i in meta.prefill_indices for r in range(meta.query_start[i], meta.query_start[i + 1])]
    torch.testing.assert_close(grouped[prefill_rows], one_by_one[prefill_rows], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (9, 1.5), (3, None)])
def test_decode_kernel_window_and_soft_cap_equal_the_reference(window, softcap):
    """The C decode kernel's sliding window (only the blocks inside it read; a window starting inside
    a block hides that block's earlier keys) and soft-capped scores, against the torch reference."""
    from asyncllm.kernels.cpu_attention import CpuAttentionBackend
    from asyncllm.kernels.torch_attention import windowed_attention
    from kernel_cases import paged_batch

    batch = paged_batch([(0, 1), (37, 1), (3, 1), (70, 1), (13, 9)], 4, 2, 32, 4, torch.float32, seed=5)
    backend = CpuAttentionBackend()
    meta = batch.meta()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    query = batch.query.contiguous() * 4
    out = backend.forward(query, k_cache, v_cache, meta, 32 ** -0.5, window=window, softcap=softcap)
    ref = windowed_attention(query, k_cache, v_cache, batch.meta(), 32 ** -0.5, window, softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype,compute_dtype", [
    pytest.param(torch.float32, None, id="f32-cache"),
    pytest.param(torch.bfloat16, None, id="bf16-cache-f32-sdpa"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-cache-bf16-sdpa"),
])
def test_fresh_prompts_read_their_new_rows_with_the_numbers_of_the_gathered_blocks(cache_dtype, compute_dtype):
    """A prefill chunk with no cached prefix attends to the rows write_kv was just given (rounded to the cache's
    dtype) instead of gathering its blocks back, and groups of adjacent chunks are read and written as slices:
    the outputs are bit for bit those of the gathering path, next to prefix chunks, decodes and a group whose
    chunks are not adjacent."""
    from asyncllm.kernels.torch_attention import TorchAttentionBackend

    specs = [(0, 5), (0, 5), (0, 6), (12, 1), (0, 6), (0, 9), (8, 4), (8, 4)]
    batch = cpu_batch(specs, 6, 2, 16, 4, seed=11)
    meta = batch.meta()
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    plan = meta.backend_state.prefills
    starts = {(g.q_len, g.seq_len): g.first_row for g in plan.groups}
    assert starts == {(5, 5): 0, (6, 6): None, (4, 12): meta.query_start[6]}
    caches = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    outputs = []
    for reuse in (True, False):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
        if reuse:  # the adjacent group's and the single's blocks are never read back: spoil them
            read_from_rows = [i for i, spec in enumerate(specs) if spec in ((0, 5), (0, 9))]
            fresh_slots = torch.tensor([batch.slots[r] for i in read_from_rows
                                        for r in range(meta.query_start[i], meta.query_start[i + 1])])
            for cache in (k_cache, v_cache):
                cache.view(-1, *cache.shape[2:])[fresh_slots] = float("nan")
        else:
            backend._new_keys = None
        output = torch.full_like(batch.query, float("nan"))
        backend.run_prefills(plan, batch.query, k_cache, v_cache, meta, 16 ** -0.5, output, compute_dtype)
        outputs.append(output)
    rows = [r for i in meta.prefill_indices for r in range(meta.query_start[i], meta.query_start[i + 1])]
    assert not outputs[0][rows].isnan().any()
    assert torch.equal(outputs[0][rows], outputs[1][rows])
    assert backend._new_keys is None  # consumed: a later layer never sees this one's rows

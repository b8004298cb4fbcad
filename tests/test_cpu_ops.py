"""The fused C elementwise kernels equal the torch reference ops, on the views the model passes them."""

from __future__ import annotations

import shutil
import pytest
import torch

from asyncllm.kernels import cpu_ops, ops

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build the CPU kernels")
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def fused(fn, *args):
    with ops.cpu_ops():
        return fn(*args)


@pytest.mark.parametrize("tokens", [3, 300])  # 300 x 512 crosses the kernels' threading threshold
def test_rms_norm_and_residual_add(tokens, threads):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = torch.randn(tokens, 512, generator=gen), torch.randn(tokens, 512, generator=gen)
    weight = torch.randn(512, generator=gen)
    torch.testing.assert_close(fused(ops.rms_norm, x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6), **TOL)
    total, normed = fused(ops.add_rms_norm, x, residual, weight, 1e-5)
    ref_total, ref_normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(normed, ref_normed, **TOL)


@pytest.mark.parametrize("tokens", [3, 300])  # 300 x 576 crosses the kernels' threading threshold
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_mixed_rms_norm_equals_converting_around_the_float32_kernel(tokens, out_dtype, threads):
    """The bf16 residual path's norm (model/decoder.py): a bf16 projection output added to the float32 residual and
    the norm rounded to bf16 in one pass, bit for bit what widening, the float32 kernel and rounding give."""
    gen = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 576, generator=gen) * 3).to(torch.bfloat16), torch.randn(tokens, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    total, normed = fused(ops.rms_norm_as, x, residual, weight, 1e-5, out_dtype)
    ref_total, ref_normed = fused(ops.add_rms_norm, x.float(), residual, weight, 1e-5)
    assert normed.dtype == out_dtype and torch.equal(total, ref_total) and torch.equal(normed, ref_normed.to(out_dtype))
    none, plain = fused(ops.rms_norm_as, residual, None, weight, 1e-5, out_dtype)
    assert none is None and torch.equal(plain, fused(ops.rms_norm, residual, weight, 1e-5).to(out_dtype))
    # the torch path off the C family: the same numbers up to rsqrt's last bit
    torch_total, torch_normed = ops.rms_norm_as(x, residual, weight, 1e-5, out_dtype)
    assert torch.equal(torch_total, total)
    torch.testing.assert_close(torch_normed.float(), normed.float(), atol=2e-5, rtol=1e-2 if out_dtype == torch.bfloat16 else 2e-5)


def test_mixed_rms_norm_refuses_what_it_cannot_take():
    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(TypeError, match="x must be float32 when there is no residual"):
        cpu_ops.rms_norm_mixed(x.bfloat16(), weight, 1e-6)
    with pytest.raises(TypeError, match="x must be a float32 or bfloat16"):
        cpu_ops.rms_norm_mixed(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="x must be a contiguous"):
        cpu_ops.rms_norm_mixed(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        cpu_ops.rms_norm_mixed(x, weight, 1e-6, torch.randn(4, 4))
    with pytest.raises(TypeError, match="out_dtype"):
        cpu_ops.rms_norm_mixed(x, weight, 1e-6, None, torch.float16)


def test_per_head_rms_norm_on_a_fused_qkv_view(threads):
    """Qwen3's q/k norms: rows are heads inside each token's slice of the qkv tensor."""
    qkv = torch.randn(7, (4 + 2 * 2) * 32)
    q = qkv[:, :128].view(7, 4, 32)
    weight = torch.randn(32)
    out = fused(ops.rms_norm, q, weight, 1e-6)
    assert out.shape == (7, 4, 32)
    torch.testing.assert_close(out, ops.rms_norm(q, weight, 1e-6), **TOL)


@pytest.mark.parametrize("tokens", [5, 100])
def test_silu_and_mul_on_gate_up_halves(tokens, threads):
    gate_up = torch.randn(tokens, 2 * 1408) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused(ops.silu_and_mul, gate, up), ops.silu_and_mul(gate, up), **TOL)


@pytest.mark.parametrize("tokens", [3, 300])
def test_silu_and_mul_in_bf16_rounds_the_float32_result_once(tokens, threads):
    """The bf16 prefill MLP's activation: bf16 halves in, float32 arithmetic, one round-to-nearest-even to bf16
    out (bit for bit torch's float32 computation rounded), NaN and infinities kept."""
    gate_up = (torch.randn(tokens, 2 * 1408) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    gate, up = gate_up.chunk(2, dim=-1)
    out = fused(ops.silu_and_mul, gate, up)
    assert out.dtype == torch.bfloat16 and out.shape == gate.shape
    expected = (torch.nn.functional.silu(gate.float()) * up.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    # the torch reference in bf16 rounds twice (silu, then the product): never closer than one rounding
    twice = ops.silu_and_mul(gate[1:], up[1:]).float()
    assert (out[1:].float() - expected[1:].float()).abs().sum() <= (twice - expected[1:].float()).abs().sum()


@pytest.mark.parametrize("tokens", [4, 600])
def test_rotary_in_place_on_qkv_views(tokens, threads):
    heads, kv_heads, dim = 8, 2, 64
    positions = torch.randint(0, 1000, (tokens,))
    angles = torch.outer(torch.arange(1000.0), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    ref_q, ref_k = ops.rotary_embedding(positions, q, k, cos, sin)
    v_before = v.clone()
    out_q, out_k = fused(ops.rotary_embedding, positions, q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(out_q, ref_q, **TOL)
    torch.testing.assert_close(out_k, ref_k, **TOL)
    assert torch.equal(v, v_before)
    with pytest.raises(IndexError, match="outside the rotary tables"):
        fused(ops.rotary_embedding, torch.full((tokens,), 1000), q, k, cos, sin)


@pytest.mark.parametrize("tokens", [4, 600])
def test_bf16_rotary_equals_the_float32_rotary_rounded_once(tokens, threads):
    """The bf16 prefill attention's rope (model/decoder.py): bf16 q/k views rotated in place with float32
    arithmetic and one rounding, bit for bit the float32 kernel's result on the widened values, rounded."""
    heads, kv_heads, dim = 9, 3, 64
    positions = torch.randint(0, 1000, (tokens,))
    angles = torch.outer(torch.arange(1000.0), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    wide_q, wide_k = q.float().contiguous(), k.float().contiguous()
    cpu_ops.rotary_embedding_(positions, wide_q, wide_k, cos, sin)
    v_before = v.clone()
    cpu_ops.rotary_embedding_(positions, q, k, cos, sin)
    assert torch.equal(q, wide_q.to(torch.bfloat16)) and torch.equal(k, wide_k.to(torch.bfloat16))
    assert torch.equal(v, v_before)
    with pytest.raises(IndexError, match="outside the rotary tables"):
        cpu_ops.rotary_embedding_(torch.full((tokens,), 1000), q, k, cos, sin)


def test_only_float32_cpu_tensors_take_the_fused_path():
    x = torch.randn(2, 8)
    assert not ops.use_cpu(x)  # not enabled outside cpu_ops()
    with ops.cpu_ops():
        assert ops.use_cpu(x) and not ops.use_cpu(x.bfloat16())
    with ops.cpu_ops(), ops.triton_ops(False):
        assert not ops.use_cpu(x)
    with pytest.raises(TypeError, match="x must be a float32"):
        cpu_ops.rms_norm(x.double(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="gate and up must be 2-d"):
        cpu_ops.silu_and_mul(x, torch.randn(2, 4))


def test_greedy_pick_equals_argmax_and_log_softmax(threads):
    logits = torch.randn(70, 5000) * 3
    logits[3, 17] = logits[3, 4000] = 100.0  # a tie: the first maximum wins, as with torch.argmax
    ids, logprobs = cpu_ops.greedy_pick(logits)
    assert ids == logits.argmax(dim=-1).tolist() and ids[3] == 17
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=1e-5)
    logits[5, 9] = float("nan")
    assert cpu_ops.greedy_pick(logits) is None  # NaN rows are left to torch's rules
    assert cpu_ops.greedy_pick(logits.double()) is None


def test_lora_kernel_equals_reference_on_a_mixed_batch(threads):
    """Ragged, interleaved adapter segments with different ranks and targets (some tokens on the base model)."""
    from asyncllm.adapters.slots import LoRASlots
    from kernel_cases import lora_adapter, lora_test_shape

    gen = torch.Generator().manual_seed(0)
    slots = LoRASlots(lora_test_shape(), max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    adapters = [lora_adapter(1, 8, ["q_proj", "v_proj", "down_proj"], slots.shapes, gen),
                lora_adapter(2, 3, ["k_proj", "o_proj", "gate_proj", "up_proj"], slots.shapes, gen),
                lora_adapter(3, 5, list(slots.shapes), slots.shapes, gen)]
    mapping = slots.activate(adapters, set())
    token_adapter = [(i * 7) % 4 for i in range(37)]  # 0 = base model
    rows: dict[int, list[int]] = {}
    for row, a in enumerate(token_adapter):
        if a:
            rows.setdefault(mapping[a], []).append(row)
    slots.set_groups(rows)
    calls = []
    real = cpu_ops.lora_apply
    for fused, width_in, width_out in (("qkv_proj", 32, 64), ("o_proj", 32, 32), ("gate_up_proj", 32, 96),
                                       ("down_proj", 48, 32)):
        x = torch.randn(37, width_in, generator=gen)
        base = torch.randn(37, width_out, generator=gen)
        expected, got = base.clone(), base.clone()
        slots.apply(1, fused, x, expected)  # torch reference (no kernel family enabled)
        with ops.cpu_ops(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_ops, "lora_apply", lambda *a: calls.append(1) or real(*a))
            slots.apply(1, fused, x, got)
        assert not torch.equal(expected, base)
        torch.testing.assert_close(got, expected, **TOL)
        untouched = [r for r, a in enumerate(token_adapter) if a == 0]
        assert torch.equal(got[untouched], base[untouched])
    assert len(calls) == 7  # one call per projection part: the kernel really ran


def test_greedy_pick_with_grammar_bitmasks(threads):
    vocab = 1000
    logits = torch.randn(4, vocab)
    allowed = [[5, 17, 900], [], None, list(range(0, vocab, 3))]  # None: an unconstrained row
    bitmask = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32)
    mask_rows, k = [], 0
    for tokens in allowed:
        if tokens is None:
            mask_rows.append(-1)
            continue
        for t in tokens:
            bitmask[k, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
        mask_rows.append(k)
        k += 1
    ids, logprobs = cpu_ops.greedy_pick(logits, bitmask, mask_rows)
    raw = torch.log_softmax(logits, dim=-1)
    for r, tokens in enumerate(allowed):
        if tokens is None:
            expected = int(logits[r].argmax())
        elif not tokens:
            expected = 0  # nothing allowed: torch's argmax over all -inf
        else:
            expected = max(tokens, key=lambda t: float(logits[r, t]))
        assert ids[r] == expected
        assert abs(logprobs[r] - float(raw[r, expected])) < 1e-5  # of the unmasked distribution


def test_every_kernel_source_builds_here(tmp_path, monkeypatch):
    """A broken C file must fail the suite, not silently send the engine down the torch path."""
    from asyncllm.kernels import cpu_build

    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path))
    names = sorted(p.stem for p in cpu_build.CSRC.glob("*.c"))
    assert names == ["decode_stack", "elementwise", "int4_linear", "int8_linear", "lora", "moe_experts",
                     "paged_decode", "prefill_attention", "sampling"]
    for name in names:
        assert cpu_build.build(name).exists()

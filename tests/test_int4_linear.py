"""The 4-bit (and 8-bit) group-quantized CPU kernel (``kernels/cpu_int4_linear.py``, ``csrc/int4_linear.c``)
against the torch reference ``F.linear(x, dequantize_groups(packed, scales, zeros, bits), bias)``: the native
build, the AVX2 build (no AVX-512) and the portable loops, each built here whatever this machine has;
``GroupQuantLinear``'s CPU dispatch (perm, leading dims, strides, threads) and its fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.kernels import cpu_build
from asyncllm.kernels import cpu_int4_linear as c4
from asyncllm.kernels.quant_linear import GroupQuantLinear, dequantize_groups, pack_int4

needs_c_kernel = pytest.mark.skipif(not c4.cpu_kernel_available(), reason="the int4 C kernel cannot be built here")
ROWS = [1, 3, 12, 13, 64, 200]  # one decode tile, several, the largest streamed block, widened panels, two blocks
# (N, K): N not a multiple of 16 (a padded last panel); K = 384 takes every group size, 576 is SmolLM2's width
SHAPES = [(70, 384), (33, 576)]
GROUPS = [32, 64, 128, None]  # None: one group per row (G = K)
CASES = [(n, k, g) for n, k in SHAPES for g in GROUPS if k % (g or k) == 0]


def _layer(n: int, k: int, group: int | None, bias: bool, seed: int = 0, bits: int = 4):
    """Random values, scales of unit-scale outputs, zero points anywhere in 0..2**bits - 1 (fractional too)."""
    gen = torch.Generator().manual_seed(seed)
    g, top = group or k, 2 ** bits - 1
    q = torch.randint(0, top + 1, (n, k), generator=gen)
    packed = pack_int4(q) if bits == 4 else q.to(torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) + 0.5) / (top / 4 * k ** 0.5)
    zeros = torch.rand(n, k // g, generator=gen) * top
    zeros[::2] = zeros[::2].round()  # integer zero points (GPTQ / AWQ) on every other row
    b = torch.randn(n, generator=gen) if bias else None
    return packed, scales, zeros, b


def _reference(x, packed, scales, zeros, b, bits=4):
    return F.linear(x.float(), dequantize_groups(packed, scales, zeros, bits), b)


def _kernel(bits):
    return c4.int4_linear_cpu if bits == 4 else c4.uint8_linear_cpu


def _assert_close(y, expected):
    """Equal up to float32 summation order: within 1e-5 of the output's scale."""
    assert y.shape == expected.shape and y.dtype == torch.float32
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * scale)


@needs_c_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k, group", CASES)
def test_kernel_matches_reference(n, k, group, bits):
    for bias in (False, True):
        packed, scales, zeros, b = _layer(n, k, group, bias, seed=n + k, bits=bits)
        for rows in ROWS:
            x = torch.randn(rows, k)
            _assert_close(_kernel(bits)(x, packed, scales, zeros, b), _reference(x, packed, scales, zeros, b, bits))


@needs_c_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_weights_dequantize_exactly_as_torch(bits):
    """Rows of the identity pick single weights: every path rounds (q - zero) * scale as torch does."""
    packed, scales, zeros, _ = _layer(40, 128, 32, False, bits=bits)
    weight = dequantize_groups(packed, scales, zeros, bits)
    for rows in (1, 5, 12, 64, 128):  # streamed (1-12 rows) and widened panels
        x = torch.eye(128)[:rows]
        assert torch.equal(_kernel(bits)(x, packed, scales, zeros), weight.T[:rows])


@pytest.mark.parametrize("build", ["no-avx512", "scalar"])
def test_other_builds_match_reference(tmp_path, build):
    """The AVX2 micro-kernels (machines without AVX-512) and the portable loops (no AVX2/FMA), each built
    here whatever this machine has. K = 48 with groups of 16 takes the portable loops in every build."""
    flags = (["-O2", "-fopenmp", "-mno-avx2", "-mno-fma", "-shared", "-fPIC"] if build == "scalar"
             else [*cpu_build._FLAGS, "-mno-avx512f"])
    try:
        lib = cpu_build.build_variant("int4_linear", flags, tmp_path / "int4_build.so", c4._SIGNATURES)
    except cpu_build.BuildError as e:
        pytest.skip(str(e))
    if build == "scalar":
        assert lib.int4_linear_isa() == 0
    elif "avx2" in cpu_build._cpu_flags().split() and "fma" in cpu_build._cpu_flags().split():
        assert lib.int4_linear_isa() == 1
    for bits in (4, 8):
        for n, k, group in [(70, 384, 32), (70, 384, 128), (33, 576, 64), (33, 576, None), (20, 48, 16)]:
            packed, scales, zeros, b = _layer(n, k, group, True, seed=k, bits=bits)
            weight = dequantize_groups(packed, scales, zeros, bits)
            for rows in ROWS:
                x = torch.randn(rows, k)
                for threads in (1, 2):
                    y = c4.call_kernel(lib, x, packed, scales, zeros, b, group or k, threads, bits=bits)
                    _assert_close(y, F.linear(x, weight, b))
            eye = torch.eye(k)[:70]  # the weights exactly as torch rounds them, streamed and in panels
            for rows in (5, 70):
                assert torch.equal(c4.call_kernel(lib, eye[:rows], packed, scales, zeros, None, group or k, 1,
                                                  bits=bits), weight.T[:rows])


@needs_c_kernel
def test_portable_loops_of_the_native_build():
    """K or G not a multiple of 32: the wrapper leaves them to torch, the C kernel's own loops take them."""
    lib = c4._library()
    packed, scales, zeros, b = _layer(24, 48, 16, True)
    for rows in (1, 7, 20):
        x = torch.randn(rows, 48)
        _assert_close(c4.call_kernel(lib, x, packed, scales, zeros, b, 16), _reference(x, packed, scales, zeros, b))
    assert c4.int4_linear_cpu(torch.randn(2, 48), packed, scales, zeros, b) is None
    y = torch.empty(1, 24)
    x = torch.randn(1, 48)
    assert lib.int4_linear_f32(x.data_ptr(), 48, 1, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), None,
                               24, 48, 20, y.data_ptr(), 24, 1) == 2  # groups that do not divide K


@needs_c_kernel
def test_layer_forward_goes_through_the_c_kernel(monkeypatch):
    lib = c4._library()
    real, calls = lib.int4_linear_f32, []
    monkeypatch.setattr(lib, "int4_linear_f32", lambda *a: calls.append(a[2]) or real(*a))
    packed, scales, zeros, b = _layer(70, 384, 64, True)
    gen = torch.Generator().manual_seed(3)
    perm = torch.randperm(384, generator=gen)
    for p in (None, perm):
        layer = GroupQuantLinear(packed, scales, zeros, bits=4, bias=b, perm=p)
        for rows in (1, 8, 130):
            x = torch.randn(rows, 384)
            expected = _reference(x if p is None else x[:, p], packed, scales, zeros, b)
            _assert_close(layer(x), expected)
    assert calls == [1, 8, 130, 1, 8, 130]
    real8, calls8 = lib.uint8_linear_f32, []
    monkeypatch.setattr(lib, "uint8_linear_f32", lambda *a: calls8.append(a[2]) or real8(*a))
    packed8, scales8, zeros8, b8 = _layer(70, 384, 128, True, bits=8)
    layer = GroupQuantLinear(packed8, scales8, zeros8, bits=8, bias=b8, perm=perm)
    for rows in (1, 130):
        x = torch.randn(rows, 384)
        _assert_close(layer(x), _reference(x[:, perm], packed8, scales8, zeros8, b8, bits=8))
    assert calls8 == [1, 130] and len(calls) == 6


@needs_c_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_many_row_calls_under_bf16_multiply_a_transient_bf16_copy(monkeypatch, bits):
    """bf16_rows (dtype="bfloat16"): calls of that many rows and more are bf16-rounded dequantized weights times
    bf16-rounded activations in float32 sums, the bias added in float32; smaller calls keep the C kernel."""
    lib = c4._library()
    name = "int4_linear_f32" if bits == 4 else "uint8_linear_f32"
    real, calls = getattr(lib, name), []
    monkeypatch.setattr(lib, name, lambda *a: calls.append(a[2]) or real(*a))
    packed, scales, zeros, b = _layer(48, 256, 64, True, bits=bits)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(5))
    for p in (None, perm):
        layer = GroupQuantLinear(packed, scales, zeros, bits=bits, bias=b, perm=p)
        layer.bf16_rows = 32
        big, small = torch.randn(2, 20, 256), torch.randn(31, 256)  # 40 rows (leading dims), then 31
        x = big if p is None else big[..., p]
        weight = dequantize_groups(packed, scales, zeros, bits, torch.bfloat16)
        expected = F.linear(x.to(torch.bfloat16), weight).float() + b
        y = layer(big)
        assert y.shape == (2, 20, 48) and y.dtype == torch.float32
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        exact = _reference(x, packed, scales, zeros, b, bits)
        assert (y - exact).abs().max() > 1e-4  # really rounded: not the float32 product
        _assert_close(layer(small), _reference(small if p is None else small[:, p], packed, scales, zeros, b, bits))
    assert calls == [31, 31]  # only the small calls reached the C kernel


@needs_c_kernel
def test_layer_with_threads_strides_and_leading_dims():
    packed, scales, zeros, b = _layer(300, 256, 32, True)
    layer = GroupQuantLinear(packed, scales, zeros, bits=4, bias=b)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the OpenMP split over panels (tests run with one thread)
    try:
        for rows in (1, 5, 70, 200):
            x = torch.randn(rows, 256)
            _assert_close(layer(x), _reference(x, packed, scales, zeros, b))
    finally:
        torch.set_num_threads(threads)
    wide = torch.randn(9, 400)
    x = wide[:, 8:264]  # rows 400 floats apart: used in place
    _assert_close(layer(x), _reference(x, packed, scales, zeros, b))
    x = torch.randn(9, 512)[:, ::2]  # not unit stride along K: copied first
    _assert_close(layer(x), _reference(x, packed, scales, zeros, b))
    x3 = torch.randn(2, 3, 256)
    y3 = layer(x3)
    assert y3.shape == (2, 3, 300)
    _assert_close(y3.reshape(6, 300), _reference(x3.reshape(6, 256), packed, scales, zeros, b))
    assert layer(torch.randn(256)).shape == (300,)
    assert layer(torch.randn(0, 256)).shape == (0, 300)


@needs_c_kernel
def test_replaced_or_updated_buffers_are_picked_up():
    """Kernel arguments are kept per packed tensor; a replaced buffer, or one written in place, is seen."""
    packed, scales, zeros, b = _layer(40, 128, 32, True)
    layer = GroupQuantLinear(packed, scales, zeros, bits=4, bias=b)
    x = torch.randn(3, 128)
    _assert_close(layer(x), _reference(x, packed, scales, zeros, b))
    layer.scales = scales * 2  # replaced
    _assert_close(layer(x), _reference(x, packed, scales * 2, zeros, b))
    other = _layer(40, 128, 32, True, seed=1)
    layer.load_state_dict(dict(zip(("packed", "scales", "zeros", "bias"), other)))  # copied in place
    _assert_close(layer(x), _reference(x, *other))
    key = id(layer.packed)
    assert key in c4._CACHE
    del layer, other, packed
    import gc

    gc.collect()
    assert key not in c4._CACHE  # the entry went with its packed tensor (it holds no reference to it)


def test_torch_fallbacks(monkeypatch):
    """No compiler / ASYNCLLM_CPU_KERNELS=0, other dtypes, shapes the kernel does not take, uneven groups:
    the kernel says None and the layer computes the torch reference."""
    packed, scales, zeros, b = _layer(40, 128, 32, True)
    x = torch.randn(5, 128)
    expected = _reference(x, packed, scales, zeros, b)
    layer = GroupQuantLinear(packed, scales, zeros, bits=4, bias=b)
    assert c4.int4_linear_cpu(x.double(), packed, scales, zeros, b) is None
    y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=3e-2, atol=3e-2)
    p48, s48, z48, b48 = _layer(24, 48, 16, True)  # K and G not multiples of 32
    x48 = torch.randn(3, 48)
    assert c4.int4_linear_cpu(x48, p48, s48, z48, b48) is None
    _assert_close(GroupQuantLinear(p48, s48, z48, bits=4, bias=b48)(x48), _reference(x48, p48, s48, z48, b48))
    p8, s8, z8, b8 = _layer(24, 48, 16, True, bits=8)
    assert c4.uint8_linear_cpu(x48, p8, s8, z8, b8) is None
    _assert_close(GroupQuantLinear(p8, s8, z8, bits=8, bias=b8)(x48), _reference(x48, p8, s8, z8, b8, bits=8))
    assert c4.uint8_linear_cpu(x, packed, scales, zeros, b) is None  # 4-bit rows: K = 64, not 128
    group_index = torch.arange(128) // 32
    uneven = GroupQuantLinear(packed, scales, zeros, bits=4, bias=b, group_index=group_index)
    _assert_close(uneven(x), expected)

    monkeypatch.setenv(cpu_build.ENV_SWITCH, "0")
    assert cpu_build.load_library.__wrapped__("int4_linear", c4._SIGNATURES) is None
    monkeypatch.setattr(c4, "_library", lambda: None)  # as with no compiler or ASYNCLLM_CPU_KERNELS=0
    c4._CACHE.clear()
    assert not c4.cpu_kernel_available() and c4.kernel_isa() is None
    assert c4.int4_linear_cpu(x, packed, scales, zeros, b) is None
    _assert_close(GroupQuantLinear(packed, scales, zeros, bits=4, bias=b)(x), expected)


def test_benchmark_runs_tiny():
    from benchmarks import int4_linear as bench

    report = bench.main(["--tiny"])
    rows = report["results"]
    assert [r["rows"] for r in rows] == [1, 8, 64]
    for r in rows:
        assert r["i4 hot"] > 0 and r["i4 cold"] > 0 and r["i4 torch hot"] > 0 and r["i8 hot"] > 0
        assert "i4 torch cold" not in r

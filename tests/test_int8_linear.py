"""Weight-only int8 linear layers: the quantization helpers, Int8Linear on CPU (the C kernel, its
scalar build, the torch fallback) and the Triton kernel (under TRITON_INTERPRET=1 without CUDA)
against the float32 reference ``F.linear(x, dequantize_weight(q, s), bias)``."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from asyncllm.kernels import int8_linear as il
from asyncllm.kernels.int8_linear import Int8Linear, cpu_int8_linear, torch_int8_linear
from asyncllm.kernels.int8_weights import dequantize_weight, quantize_weight
from kernel_cases import DEVICE

needs_c_kernel = pytest.mark.skipif(not il.cpu_kernel_available(), reason="the int8 C kernel cannot be built here")
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 17, 23, 24, 32, 64, 130]  # every tile height of the C paths (AVX-512: up to 12)
# (N, K, G): per channel and G = 32 on SmolLM2-like and odd widths; N not a multiple of 16 (a
# padded last panel), K not a multiple of 64 (72, 96) or of 8 (per channel 100, 99: K loops with a
# remainder), groups of 8, 24 and 6
SHAPES = [(70, 96, 32), (70, 96, None), (48, 72, 8), (33, 100, None), (40, 72, 24), (200, 576, 32),
          (200, 576, None), (33, 99, None), (24, 90, 6)]


def _layer(n: int, k: int, group: int | None, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5  # unit-scale outputs
    b = torch.randn(n, generator=gen) if bias else None
    q, s = quantize_weight(weight, group)
    return q, s, b


def _reference(x, q, s, b):
    return F.linear(x.float(), dequantize_weight(q, s), b)


# ---- quantization helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 32, 8])
def test_quantize_round_trip_is_within_half_a_step(group):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 96, generator=gen) * torch.linspace(0.01, 3, 96)  # columns of very different size
    q, s = quantize_weight(w, group)
    g = group or 96
    assert q.dtype == torch.int8 and q.shape == (37, 96)
    assert s.dtype == torch.float32 and s.shape == (37, 96 // g)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    step = s.repeat_interleave(g, dim=1)
    err = (dequantize_weight(q, s) - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-5)).all())
    # each group's largest value is represented exactly (up to float rounding)
    groups = w.view(37, 96 // g, g).abs().amax(-1)
    torch.testing.assert_close(s * 127, groups)


def test_zero_groups_dequantize_to_zero():
    w = torch.randn(4, 64)
    w[1] = 0
    w[2, 32:] = 0
    for group in (None, 32):
        q, s = quantize_weight(w, group)
        assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
        d = dequantize_weight(q, s)
        assert not bool(d.isnan().any())
        assert bool((d[1] == 0).all()) and bool((d[2, 32:] == 0).all())


def test_quantize_accepts_bfloat16_weights():
    w = torch.randn(8, 32).to(torch.bfloat16)
    q, s = quantize_weight(w, 16)
    assert (dequantize_weight(q, s) - w.float()).abs().max() <= s.max() / 2 + 1e-6


@pytest.mark.parametrize("weight, group, message", [
    (torch.randn(4, 96), 40, "does not divide"),
    (torch.randn(4, 96), 0, "positive"),
    (torch.randn(4, 96), -32, "positive"),
    (torch.randn(4, 96), 32.0, "int or None"),
    (torch.randn(96), None, "2-d"),
    (torch.randint(0, 5, (4, 96)), None, "floating-point"),
    (torch.full((2, 8), float("nan")), None, "NaN"),
])
def test_quantize_rejects_bad_arguments(weight, group, message):
    with pytest.raises(ValueError, match=message):
        quantize_weight(weight, group)


def test_dequantize_and_layer_reject_mismatched_pairs():
    q, s = quantize_weight(torch.randn(6, 64), 32)
    with pytest.raises(ValueError, match="rows"):
        dequantize_weight(q, s[:5])
    with pytest.raises(ValueError, match="do not divide"):
        dequantize_weight(q, torch.ones(6, 3))
    with pytest.raises(ValueError, match="int8"):
        dequantize_weight(q.float(), s)
    with pytest.raises(ValueError, match="rows"):
        Int8Linear(q, s[:5])
    with pytest.raises(ValueError, match="bias"):
        Int8Linear(q, s, torch.zeros(7))
    with pytest.raises(ValueError, match="features"):
        Int8Linear(q, s)(torch.randn(2, 63))


# ---- CPU: the C kernel ------------------------------------------------------------------------------


@needs_c_kernel
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n, k, group", SHAPES, ids=[f"{n}x{k}-g{g or 'chan'}" for n, k, g in SHAPES])
def test_c_kernel_matches_reference(n, k, group, bias):
    q, s, b = _layer(n, k, group, bias)
    layer = Int8Linear(q, s, b)
    assert layer.group_size == (group or k) and (layer.in_features, layer.out_features) == (k, n)
    gen = torch.Generator().manual_seed(2)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        y = layer(x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        torch.testing.assert_close(y, _reference(x, q, s, b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cpu_int8_linear(x, q, s, b), y, rtol=0, atol=0)


@needs_c_kernel
@pytest.mark.skipif(not il.bf16_dot_available(), reason="no AVX512-BF16 build of the int8 kernel here")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n, k, group", SHAPES, ids=[f"{n}x{k}-g{g or 'chan'}" for n, k, g in SHAPES])
def test_bf16_dot_products_equal_the_bf16_rounded_product(n, k, group, bias):
    """``bf16_dot``: up to 12 rows the float32 kernel, bit for bit; from 13 rows (K and G multiples of 8) the
    product of bf16-rounded activations and bf16-rounded dequantized weights, summed in float32 (other shapes:
    the float32 kernel)."""
    q, s, b = _layer(n, k, group, bias)
    layer = Int8Linear(q, s, b)
    exact = Int8Linear(q, s, b)
    layer.bf16_dot = True
    dot_shape = k % 8 == 0 and (group or k) % 8 == 0
    gen = torch.Generator().manual_seed(5)
    weight = dequantize_weight(q, s)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        y = layer(x)
        if rows <= 12 or not dot_shape:
            torch.testing.assert_close(y, exact(x), rtol=0, atol=0)
            continue
        rounded = F.linear(x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float(), b)
        torch.testing.assert_close(y, rounded, rtol=1e-5, atol=1e-5)
        assert not torch.equal(y, exact(x))  # the bf16 arithmetic did run


@needs_c_kernel
def test_forward_goes_through_the_c_kernel(monkeypatch):
    lib = il._library()
    real, calls = lib.int8_linear_f32, []
    monkeypatch.setattr(lib, "int8_linear_f32", lambda *a: calls.append(a[2]) or real(*a))
    q, s, b = _layer(40, 64, 32, True)
    layer = Int8Linear(q, s, b)
    for rows in (1, 8, 130):
        layer(torch.randn(rows, 64))
    assert calls == [1, 8, 130]


@needs_c_kernel
def test_c_kernel_with_threads_strides_and_leading_dims():
    q, s, b = _layer(300, 192, 32, True)
    layer = Int8Linear(q, s, b)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the OpenMP split over panels (tests run with one thread)
    try:
        for rows in (1, 5, 70):
            x = torch.randn(rows, 192)
            torch.testing.assert_close(layer(x), _reference(x, q, s, b), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)
    wide = torch.randn(9, 400)
    x = wide[:, 8:200]  # rows 400 floats apart: used in place
    torch.testing.assert_close(layer(x), _reference(x, q, s, b), rtol=1e-4, atol=1e-4)
    x = wide[:, ::2][:, :192]  # not unit stride along K: copied first
    torch.testing.assert_close(layer(x), _reference(x, q, s, b), rtol=1e-4, atol=1e-4)
    x3 = torch.randn(2, 3, 192)
    y3 = layer(x3)
    assert y3.shape == (2, 3, 300)
    torch.testing.assert_close(y3, _reference(x3.reshape(6, 192), q, s, b).reshape(2, 3, 300), rtol=1e-4, atol=1e-4)
    assert layer(torch.randn(0, 192)).shape == (0, 300)


@pytest.mark.parametrize("build, rows_list", [
    ("scalar", (1, 2, 3, 8, 70)),
    ("no-avx512", (1, 2, 3, 6, 8, 13, 17, 32, 70)),
])
def test_other_builds_of_the_c_kernel_match_reference(tmp_path, build, rows_list):
    """The portable loops (machines without AVX2/FMA) and the AVX2 micro-kernels (machines without
    AVX-512), each built here whatever this machine has. The AVX2 build differs from the native one
    only by AVX-512, whose micro-kernel sums in the same order: equal to the bit."""
    from asyncllm.kernels.cpu_build import _FLAGS, BuildError, build_variant

    flags = (["-O2", "-fopenmp", "-mno-avx2", "-mno-fma", "-shared", "-fPIC"] if build == "scalar"
             else [*_FLAGS, "-mno-avx512f"])
    try:
        lib = build_variant("int8_linear", flags, tmp_path / "int8_build.so", il._SIGNATURES)
    except BuildError as e:
        pytest.skip(str(e))
    for n, k, group in [(33, 100, None), (40, 72, 24), (70, 96, 32), (24, 90, 6), (40, 96, None)]:
        q, s, b = _layer(n, k, group, True)
        for rows in rows_list:
            x = torch.randn(rows, k)
            y = torch.empty(rows, n)
            assert lib.int8_linear_f32(x.data_ptr(), k, rows, q.data_ptr(), s.data_ptr(), b.data_ptr(), n, k,
                                       k // s.shape[1], y.data_ptr(), n, 1) == 0
            torch.testing.assert_close(y, _reference(x, q, s, b), rtol=1e-4, atol=1e-4)
            if build == "no-avx512" and il.cpu_kernel_available():
                assert torch.equal(y, il.cpu_int8_linear(x, q, s, b))


@needs_c_kernel
def test_c_kernel_rejects_groups_that_do_not_divide_k():
    q, s, _ = _layer(16, 64, 32, False)
    y = torch.empty(1, 16)
    x = torch.randn(1, 64)
    assert il._library().int8_linear_f32(x.data_ptr(), 64, 1, q.data_ptr(), s.data_ptr(), None, 16, 64,
                                         24, y.data_ptr(), 16, 1) == 2


# ---- CPU: layout and module mechanics ---------------------------------------------------------------


def test_module_state_moves_and_inspection():
    q, s, b = _layer(40, 64, 32, True)
    layer = Int8Linear(q, s, b)
    assert torch.equal(layer.qweight, q) and layer.qweight.is_contiguous()  # row-major, as the decode stack reads it
    torch.testing.assert_close(layer.weight, dequantize_weight(q, s), rtol=0, atol=0)
    x = torch.randn(3, 64)
    y = layer(x)
    state = layer.state_dict()
    assert set(state) == {"qweight", "scales", "bias"} and torch.equal(state["qweight"], q)
    other = Int8Linear(torch.zeros_like(q), torch.ones_like(s), torch.zeros(40))
    other(x)  # kernel arguments made for the old values ...
    other.load_state_dict(state)  # ... which are overwritten in place
    torch.testing.assert_close(other(x), y, rtol=0, atol=0)
    other.scales = s * 2  # a replaced buffer is picked up
    torch.testing.assert_close(other(x), _reference(x, q, s * 2, b), rtol=1e-4, atol=1e-4)
    assert "group_size=32" in repr(layer) and "out_features=40" in repr(layer)
    assert "group_size=channel" in repr(Int8Linear.from_float(torch.randn(8, 16)))
    moved = Int8Linear(q, s, b).to("meta")
    assert moved.qweight.device.type == "meta" and moved.qweight.shape == (40, 64) and moved._c_args is None
    wide = layer.to(torch.float64)  # scales and bias widen; the kernel still gets float32 copies
    assert wide.scales.dtype == torch.float64 and wide.qweight.dtype == torch.int8
    torch.testing.assert_close(wide(x), y, rtol=1e-6, atol=1e-6)


def test_from_float_and_from_linear():
    linear = torch.nn.Linear(64, 24)
    layer = Int8Linear.from_linear(linear, group_size=32)
    x = torch.randn(5, 64)
    q, s = quantize_weight(linear.weight.detach(), 32)
    torch.testing.assert_close(layer(x), _reference(x, q, s, linear.bias.detach()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer(x), linear(x).detach(), rtol=0.05, atol=0.05)  # int8 is close to float


def test_bfloat16_inputs_on_cpu():
    q, s, b = _layer(40, 64, None, True)
    layer = Int8Linear(q, s, b)
    x = torch.randn(6, 64).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _reference(x, q, s, b), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("n, k, group", [(70, 96, 32), (33, 100, None)])
def test_torch_fallback_without_the_c_kernel(n, k, group, monkeypatch):
    monkeypatch.setattr(il, "_library", lambda: None)  # as with no compiler or ASYNCLLM_CPU_KERNELS=0
    assert not il.cpu_kernel_available()
    q, s, b = _layer(n, k, group, True)
    layer = Int8Linear(q, s, b)
    for rows in (1, 17, 130):
        x = torch.randn(rows, k)
        expected = _reference(x, q, s, b)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch_int8_linear(x, q, s, b), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_int8_linear(torch.randn(1, k), q, s, b)


# ---- Triton -----------------------------------------------------------------------------------------

TRITON_CASES = [(40, 96, None), (40, 96, 32), (33, 72, 8), (20, 48, 24), (70, 128, 64)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 4e-2)])
def test_triton_kernel_matches_reference(dtype, tolerance):
    pytest.importorskip("triton")
    from asyncllm.kernels.triton_int8_linear import int8_linear

    for n, k, group in TRITON_CASES:
        q, s, b = _layer(n, k, group, True, seed=n + k)
        q, s, b = q.to(DEVICE), s.to(DEVICE), b.to(DEVICE)
        for rows in (1, 5, 40):
            x = torch.randn(rows, k, device=DEVICE).to(dtype)
            for bias in (None, b):
                y = int8_linear(x, q, s, bias)
                assert y.dtype == dtype and y.shape == (rows, n)
                torch.testing.assert_close(y.float(), _reference(x, q, s, bias), rtol=tolerance, atol=tolerance)


def test_triton_launch_shapes():
    pytest.importorskip("triton")
    from asyncllm.kernels.triton_int8_linear import _blocks

    assert _blocks(1, 576, 576, 576)[3] == 0          # per channel: scales applied at the end
    assert _blocks(1, 576, 576, 32)[2:] == (32, 1)    # Q8_0: one K step per group
    assert _blocks(300, 576, 1536, 128)[2:] == (64, 1)
    assert _blocks(8, 48, 72, 24)[3] == 2             # any other group: scaled per element


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_module_on_cuda_uses_triton():
    q, s, b = _layer(96, 128, 32, True)
    layer = Int8Linear(q, s, b).cuda()
    assert layer.qweight.is_cuda
    x = torch.randn(7, 128, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(layer(x).float(), _reference(x, q.cuda(), s.cuda(), b.cuda()), rtol=1e-2, atol=1e-2)


# ---- the benchmark script ---------------------------------------------------------------------------


def test_benchmark_runs_tiny():
    from benchmarks import int8_linear as bench

    report = bench.main(["--tiny"])
    rows = report["results"]
    assert [r["rows"] for r in rows] == [1, 8, 64]
    for r in rows:
        assert r["F.linear hot"] > 0 and r["i8 chan cold"] > 0 and r["i8 g32 hot"] > 0
    assert "i8 widen hot" in rows[-1] and "i8 widen hot" not in rows[0]

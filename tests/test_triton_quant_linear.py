"""The Triton kernels of quantized checkpoints (asyncllm/kernels/triton_quant_linear.py) against the torch
reference of asyncllm/kernels/quant_linear.py: ``F.linear(x, dequantize_groups(...) / dequantize_fp8(...), b)``
in float32 over the same (already rounded) inputs.

Without CUDA the kernels run in triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at small
shapes, the layers' CUDA branch runs on CPU tensors, and a subprocess compiles the kernels for sm_90, sm_89
and sm_80 with the real compiler. With CUDA the same sweeps run the compiled kernels, and the CUDA-only
tests at the end add model-sized shapes and the layers' dispatch; scripts/gpu_check.sh runs those and the
byte-exact FP8 test (scripts/gpu_tests.txt)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from asyncllm.kernels import quant_linear as ql  # noqa: E402
from asyncllm.kernels import triton_quant_linear as tq  # noqa: E402
from asyncllm.kernels.quant_linear import (Fp8Linear, GroupQuantLinear, dequantize_fp8,  # noqa: E402
                                           dequantize_groups, pack_int4)
from kernel_cases import DEVICE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# outputs are about unit scale: fp32 sums in another order; fp16 / bf16 one rounding of the output
# (and, per element, of the weight where it is dequantized before the dot)
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}
needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (runs from scripts/gpu_tests.txt)")


def _group_layer(n: int, k: int, group: int, bits: int, seed: int, integer_zeros: bool = True):
    """(packed, scales, zeros, bias) with random codes and zero points, scaled for unit-size outputs."""
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, top + 1, (n, k // group), generator=gen).float()
    if not integer_zeros:
        zeros = zeros + torch.rand(zeros.shape, generator=gen) - 0.5
    scales = (torch.rand(n, k // group, generator=gen) + 0.5) / (top * 0.6 * k ** 0.5)
    bias = torch.randn(n, generator=gen)
    packed = pack_int4(q) if bits == 4 else q
    return [t.to(DEVICE) for t in (packed, scales, zeros, bias)]


def _group_reference(x, packed, scales, zeros, bits, bias):
    return F.linear(x.float(), dequantize_groups(packed, scales, zeros, bits), bias)


def _close(y, expected, dtype, rows, n):
    assert y.dtype == dtype and y.shape == (rows, n)
    torch.testing.assert_close(y.float(), expected, rtol=TOL[dtype], atol=TOL[dtype])


# ---- group-quantized (4 / 8 bits) ----------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_kernel_matches_reference(dtype, bits):
    """M {1, 5, 33} x N {16, 40} x K {64, 128} x G {32, 64, K} x bias or not."""
    gen = torch.Generator().manual_seed(bits)
    for n in (16, 40):
        for k in (64, 128):
            for group in sorted({32, 64, k}):
                packed, scales, zeros, b = _group_layer(n, k, group, bits, seed=n + k + group)
                for rows in (1, 5, 33):
                    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
                    for bias in (None, b):
                        y = tq.group_quant_linear(x, packed, scales, zeros, bits, bias)
                        _close(y, _group_reference(x, packed, scales, zeros, bits, bias), dtype, rows, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_kernel_other_groupings(dtype):
    """Groups no K step divides (scaled per element), K with a tail, fractional zero points, strided x."""
    gen = torch.Generator().manual_seed(5)
    for bits, n, k, group in [(4, 24, 48, 24), (8, 24, 48, 24), (4, 40, 72, 72), (8, 17, 100, 100),
                              (4, 16, 96, 32), (8, 16, 48, 16)]:
        packed, scales, zeros, b = _group_layer(n, k, group, bits, seed=k, integer_zeros=False)
        for rows in (1, 19):
            x = torch.randn(rows, 2 * k, generator=gen).to(dtype).to(DEVICE)[:, ::2]  # stride 2 along K
            y = tq.group_quant_linear(x, packed, scales, zeros, bits, b)
            _close(y, _group_reference(x, packed, scales, zeros, bits, b), dtype, rows, n)


def test_launch_shapes():
    assert tq._blocks(1, 4096, 4096, 128) == (16, 32, 64, 1)     # decode, group 128: two K steps a group
    assert tq._blocks(1, 4096, 4096, 32)[2:] == (32, 1)          # one K step per group
    assert tq._blocks(300, 4096, 4096, 4096) == (64, 128, 64, 1)  # one group per row
    assert tq._blocks(5, 40, 48, 24)[3] == 2                     # no K step divides 24: per element
    assert tq._blocks(5, 40, 100, None)[2:] == (64, 0)           # fp8 per row: scaled at the end
    assert tq._blocks(5, 8, 64, 32)[1] == 16                     # tl.dot needs 16 columns at least


def test_group_kernel_rejects_bad_arguments():
    packed, scales, zeros, b = _group_layer(16, 64, 32, 4, seed=0)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="bits"):
        tq.group_quant_linear(x, packed, scales, zeros, 3)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        tq.group_quant_linear(x[:, :32], packed, scales, zeros, 4)
    with pytest.raises(TypeError, match="float16"):
        tq.group_quant_linear(x.double(), packed, scales, zeros, 4)
    with pytest.raises(ValueError, match="groups dividing"):
        tq.group_quant_linear(x, packed, scales[:, :1].expand(16, 3), zeros, 4)
    with pytest.raises(ValueError, match="zeros"):
        tq.group_quant_linear(x, packed, scales, zeros[:, :1], 4)
    with pytest.raises(ValueError, match="bias"):
        tq.group_quant_linear(x, packed, scales, zeros, 4, b[:3])
    assert tq.group_quant_linear(x[:0], packed, scales, zeros, 4).shape == (0, 16)


# ---- FP8 weights ---------------------------------------------------------------------------------------

def _fp8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 40).clamp(-440, 440).to(torch.float8_e4m3fn)


# (N, K, block): None = the scale is per tensor ("tensor") or per row ("row"); else (bn, bk)
FP8_CASES = [(16, 64, "tensor"), (40, 128, "row"), (40, 100, "row"), (40, 128, (1, 32)), (40, 128, (128, 128)),
             (40, 100, (16, 64)), (16, 72, (2, 24)), (40, 64, (1, 128))]


def _fp8_scale(n, k, block, gen):
    if block == "tensor":
        return torch.rand((), generator=gen) / (40 * k ** 0.5) + 1e-3, None
    if block == "row":
        return (torch.rand(n, 1, generator=gen) + 0.5) / (40 * k ** 0.5), None
    bn, bk = block
    return (torch.rand(-(-n // bn), -(-k // bk), generator=gen) + 0.5) / (40 * k ** 0.5), block


@pytest.mark.parametrize("native", [True, False], ids=["fp8-type", "bytes"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_kernel_matches_reference(dtype, native):
    """Per tensor, per row, per (1, bk) and (bn, bk) block (bk a multiple of the K step, or not: 24),
    K with a tail (100, 72), M {1, 5, 33}, bias or not; both ways of widening e4m3."""
    gen = torch.Generator().manual_seed(7)
    for n, k, kind in FP8_CASES:
        weight = _fp8_weight(n, k, seed=n * k).to(DEVICE)
        scale, block = _fp8_scale(n, k, kind, gen)
        scale = scale.to(DEVICE)
        b = torch.randn(n, generator=gen).to(DEVICE)
        w = dequantize_fp8(weight, scale, block)
        block_n, block_k = block if block is not None else (1, None)
        for rows in (1, 5, 33):
            x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
            for bias in (None, b):
                y = tq.fp8_linear(x, weight, scale, block_k, bias, block_n=block_n, native=native)
                _close(y, F.linear(x.float(), w, bias), dtype, rows, n)


@pytest.mark.parametrize("native", [True, False], ids=["fp8-type", "bytes"])
def test_fp8_widening_is_exact_for_every_byte(native):
    """Every e4m3 byte but the two NaNs, subnormals and +-0 included: y = I @ W.T is W, bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.view(torch.float8_e4m3fn).reshape(16, 16).to(DEVICE)
    eye = torch.eye(16, device=DEVICE)
    y = tq.fp8_linear(eye, weight, torch.ones(16, 1, device=DEVICE), native=native)
    assert torch.equal(y, weight.float().T)


def test_fp8_kernel_rejects_bad_arguments():
    weight = _fp8_weight(16, 64, 0).to(DEVICE)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tq.fp8_linear(x, weight.float(), torch.ones(16, 1, device=DEVICE))
    with pytest.raises(ValueError, match="scale must be"):
        tq.fp8_linear(x, weight, torch.ones(8, 1, device=DEVICE))
    with pytest.raises(ValueError, match="block_k"):
        tq.fp8_linear(x, weight, torch.ones(16, 2, device=DEVICE))
    with pytest.raises(ValueError, match="block_k"):
        tq.fp8_linear(x, weight, torch.ones(16, 2, device=DEVICE), 16)
    assert tq.fp8_linear(x[:0], weight, torch.ones(16, 1, device=DEVICE)).shape == (0, 16)


# ---- the layers' CUDA branch, run here on CPU tensors ----------------------------------------------------

class _OnCuda:
    """What the layers' CUDA branch checks of a weight (``is_cuda``), carrying the CPU tensor that the
    interpreted kernel then reads: the branch's own arithmetic (act-order gather, leading dimensions,
    FP8 scale kinds) runs without a GPU."""

    is_cuda = True

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@pytest.fixture
def unwrap_weights(monkeypatch):
    group, fp8 = tq.group_quant_linear, tq.fp8_linear
    calls = []

    def group_kernel(x, packed, *args, **kwargs):
        calls.append("group")
        return group(x, packed.tensor, *args, **kwargs)

    def fp8_kernel(x, weight, *args, **kwargs):
        calls.append("fp8")
        return fp8(x, weight.tensor, *args, **kwargs)

    monkeypatch.setattr(tq, "group_quant_linear", group_kernel)
    monkeypatch.setattr(tq, "fp8_linear", fp8_kernel)
    return calls


def _as_if_on_cuda(layer, weight_name):
    fields = dict(vars(layer)["_buffers"], in_features=layer.in_features, out_features=layer.out_features,
                  bits=getattr(layer, "bits", None), block=getattr(layer, "block", None))
    fields[weight_name] = _OnCuda(fields[weight_name])
    return SimpleNamespace(**fields)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the layers themselves are tested below")
def test_group_layer_cuda_branch(unwrap_weights):
    gen = torch.Generator().manual_seed(11)
    packed, scales, zeros, b = _group_layer(40, 128, 32, 4, seed=1)
    perm = torch.randperm(128, generator=gen)
    x = torch.randn(2, 3, 128, generator=gen)
    for layer in (GroupQuantLinear(packed, scales, zeros, 4, b, perm), GroupQuantLinear(packed, scales, zeros, 4)):
        y = ql._triton_group_forward(_as_if_on_cuda(layer, "packed"), x)
        torch.testing.assert_close(y, layer(x), rtol=1e-4, atol=1e-4)  # layer(x): the torch path on CPU
    uneven = GroupQuantLinear(packed, scales, zeros, 4, group_index=torch.arange(128) // 32)
    assert ql._triton_group_forward(_as_if_on_cuda(uneven, "packed"), x) is None  # torch path
    assert ql._triton_group_forward(_as_if_on_cuda(layer, "packed"), x.double()) is None
    assert unwrap_weights == ["group", "group"]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the layers themselves are tested below")
@pytest.mark.parametrize("n, k, kind", [(40, 128, "tensor"), (40, 128, "row"), (40, 100, (16, 64)),
                                        (40, 128, (1, 32))])
def test_fp8_layer_cuda_branch(unwrap_weights, n, k, kind):
    gen = torch.Generator().manual_seed(13)
    scale, block = _fp8_scale(n, k, kind, gen)
    if kind == "row":
        scale = scale.reshape(n)  # checkpoints store per-row scales as [N] too
    layer = Fp8Linear(_fp8_weight(n, k, 3), scale, block, torch.randn(n, generator=gen))
    x = torch.randn(3, 1, k, generator=gen)
    y = ql._triton_fp8_forward(_as_if_on_cuda(layer, "weight"), x)
    torch.testing.assert_close(y, layer(x), rtol=1e-4, atol=1e-4)
    assert unwrap_weights == ["fp8"]


# ---- compiled for real GPUs, without one ---------------------------------------------------------------

def _compile_all() -> None:
    """One JSON line per kernel specialisation compiled (the launcher's, for a 4096 x 4096 layer)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compile_kernels import launch_specialisation

    def compile_kernel(name, fn, pointers, constexprs, ints, arch):
        constexprs, attrs = launch_specialisation(fn, pointers, ints, constexprs)
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": 4})
        print(json.dumps({"kernel": name, "arch": arch, "shared": kernel.metadata.shared}), flush=True)

    for dtype, bits, m, group in [("bf16", 4, 1, 128), ("fp16", 4, 300, 128), ("bf16", 8, 7, 32),
                                  ("fp32", 4, 300, 4096), ("bf16", 4, 7, 24)]:
        block_m, block_n, block_k, mode = tq._blocks(m, 4096, 4096, group)
        compile_kernel(f"group_quant_linear {dtype} bits{bits} m{m} g{group}", tq._group_quant_linear_kernel,
                       dict(X=f"*{dtype}", P="*u8", S="*fp32", Z="*fp32", B="*fp32", Y=f"*{dtype}"),
                       dict(BITS=bits, HAS_BIAS=True, SCALE_MODE=mode, UPCAST=False, IEEE_DOT=dtype == "fp32",
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k),
                       dict(M=m, N=4096, K=4096, G=group, stride_xm=4096, stride_pn=4096 * bits // 8,
                            stride_sn=4096 // group, stride_zn=4096 // group, stride_ym=4096), 90)
    for native, arch, m, scale_bk in [(True, 90, 1, 4096), (True, 90, 300, 128), (False, 80, 300, 128),
                                      (False, 80, 7, 24), (True, 89, 7, 128)]:
        block_m, block_n, block_k, mode = tq._blocks(m, 4096, 4096, None if scale_bk == 4096 else scale_bk)
        compile_kernel(f"fp8_linear native={native} m{m} bk{scale_bk}", tq._fp8_linear_kernel,
                       dict(X="*bf16", W="*fp8e4nv" if native else "*u8", S="*fp32", B="*fp32", Y="*bf16"),
                       dict(NATIVE_FP8=native, HAS_BIAS=False, SCALE_MODE=mode, UPCAST=False, IEEE_DOT=False,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k),
                       dict(M=m, N=4096, K=4096, SCALE_BK=scale_bk, SCALE_BN=128, stride_xm=4096, stride_wn=4096,
                            stride_sn=-(-4096 // scale_bk), stride_ym=4096), arch)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the kernels are compiled and run by the tests above")
def test_kernels_compile_for_sm90_and_sm80():
    """The real compiler (down to ptxas, shipped with triton) on the launch specialisations: sm_90 for both
    kernels, sm_89 for the e4m3 type, sm_80 for the byte-widening FP8 path; within Hopper's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(kernels) == 10
    assert all(k["shared"] <= 227 * 1024 for k in kernels), kernels


# ---- CUDA only: model-sized shapes and the layers ------------------------------------------------------

# Each launch specialisation compiles once on a GPU (about half a second): the sweeps above make some
# 500, so scripts/gpu_tests.txt names only the tests below (about 40) and the byte-exact FP8 one.

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_group_kernel_model_shapes(dtype):
    gen = torch.Generator().manual_seed(17)
    for bits, n, k, group, row_counts in [(4, 4096, 4096, 128, (1, 37, 300)), (4, 1536, 8960, 128, (1, 300)),
                                          (8, 2048, 4096, 32, (1, 300)), (4, 1024, 4096, 4096, (1, 300))]:
        packed, scales, zeros, b = _group_layer(n, k, group, bits, seed=n)
        w = dequantize_groups(packed, scales, zeros, bits)
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
            _close(tq.group_quant_linear(x, packed, scales, zeros, bits, b), F.linear(x.float(), w, b), dtype, rows, n)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_fp8_kernel_model_shapes(dtype):
    gen = torch.Generator().manual_seed(19)
    for n, k, kind in [(4096, 7168, (128, 128)), (2048, 4096, "row"), (2048, 4096, "tensor")]:
        weight = _fp8_weight(n, k, seed=n).to(DEVICE)
        scale, block = _fp8_scale(n, k, kind, gen)
        scale = scale.to(DEVICE)
        w = dequantize_fp8(weight, scale, block)
        block_n, block_k = block if block is not None else (1, None)
        for rows in (1, 300):
            x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
            for native in ((True, False) if kind == (128, 128) else (True,)):
                y = tq.fp8_linear(x, weight, scale, block_k, None, block_n=block_n, native=native)
                _close(y, F.linear(x.float(), w), dtype, rows, n)


@needs_cuda
def test_cuda_layers_use_the_kernels(monkeypatch):
    calls = []
    for name in ("group_quant_linear", "fp8_linear"):
        kernel = getattr(tq, name)
        monkeypatch.setattr(tq, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    gen = torch.Generator().manual_seed(23)
    packed, scales, zeros, b = _group_layer(96, 256, 64, 4, seed=2)
    perm = torch.randperm(256, generator=gen).to(DEVICE)
    layer = GroupQuantLinear(packed, scales, zeros, 4, b, perm)
    x = torch.randn(2, 5, 256, generator=gen).to(DEVICE, torch.float16)
    expected = F.linear(x.float()[..., perm], layer.dequantize(), b)
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2)
    scale = ((torch.rand(1, 2, generator=gen) + 0.5) / 640).to(DEVICE)
    fp8 = Fp8Linear(_fp8_weight(96, 256, 4).to(DEVICE), scale, (128, 128), b)
    torch.testing.assert_close(fp8(x).float(), F.linear(x.float(), fp8.dequantize(), b), rtol=1e-2, atol=1e-2)
    assert calls == ["group_quant_linear", "fp8_linear"]


if __name__ == "__main__":
    _compile_all()

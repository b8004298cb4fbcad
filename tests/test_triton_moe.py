"""The fused MoE Triton kernels (asyncllm/kernels/triton_moe.py) against the per-token torch oracle of
model/moe.py. Without CUDA they run in triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at
small shapes; with CUDA the same cases run compiled (scripts/gpu_tests.txt lists this file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from asyncllm.kernels.triton_moe import align_pairs, fused_experts  # noqa: E402
from asyncllm.model.moe import expert_activation, reference_experts, route  # noqa: E402
from asyncllm.model.shape import MoEShape  # noqa: E402
from kernel_cases import DEVICE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def test_pairs_are_laid_out_by_expert_in_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # pairs 0..5: experts 3, 0, 3, 1, 0, 3
    pair_map, block_expert = align_pairs(ids, 0, 4, block_m=2)
    blocks = block_expert.tolist()
    assert len(blocks) == 3 + 4  # pairs / block + experts: a bound fixed by the shapes
    assert blocks[:4] == [0, 1, 3, 3] and all(b == -1 for b in blocks[4:])
    assert pair_map[:8].tolist() == [1, 4, 3, -1, 0, 2, 5, -1]
    # expert-parallel rank holding experts 2..3: the others' pairs are left out
    pair_map, block_expert = align_pairs(ids, 2, 2, block_m=2)
    assert block_expert.tolist()[:2] == [1, 1] and pair_map[:4].tolist() == [0, 2, 5, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(tokens=1, experts=4, top_k=2),
    dict(tokens=5, experts=8, top_k=2, hidden=48, inter=24),         # shapes off the block sizes
    dict(tokens=19, experts=4, top_k=1, activation="swiglu_clamped", bias=True),
    dict(tokens=7, experts=6, top_k=3, on_input=True),
    dict(tokens=9, experts=8, top_k=2, first_expert=4, local=4),     # an expert-parallel rank's half
])
def test_fused_experts_equal_the_torch_oracle(case, dtype):
    tokens, experts, k = case["tokens"], case["experts"], case["top_k"]
    hidden, inter = case.get("hidden", 32), case.get("inter", 16)
    first, local = case.get("first_expert", 0), case.get("local", experts)
    activation = case.get("activation", "silu")
    torch.manual_seed(tokens)
    moe = MoEShape(num_experts=experts, top_k=k, intermediate_size=inter, activation=activation)
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter) / inter ** 0.5
    b13, b2 = (torch.randn(experts, 2 * inter), torch.randn(experts, hidden)) if case.get("bias") else (None, None)
    weights, ids = route(torch.randn(tokens, experts), moe)
    on_input = case.get("on_input", False)
    # the oracle over this rank's experts only: the other ranks' are zero here
    keep = torch.zeros(experts, 1, 1)
    keep[first:first + local] = 1
    expected = reference_experts(x, weights, ids, w13 * keep, w2 * keep, expert_activation(moe),
                                 None if b13 is None else b13 * keep[:, :, 0],
                                 None if b2 is None else b2 * keep[:, :, 0], on_input)

    def dev(t):
        return None if t is None else t[first:first + local].to(DEVICE, dtype)

    got = fused_experts(x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE), dev(w13), dev(w2), first,
                        dev(b13), dev(b2), 0 if activation == "silu" else 1, moe.swiglu_alpha, moe.swiglu_limit,
                        on_input)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float().cpu(), expected, rtol=TOL[dtype], atol=TOL[dtype] * 4)


def test_engine_on_triton_runs_the_fused_kernel_and_equals_transformers(model_dir_factory, monkeypatch):
    """A Qwen3-MoE engine on the Triton backend (interpreted here, compiled on CUDA) routes its experts through
    the fused kernel and still gives transformers' greedy tokens."""
    from asyncllm import LLM, SamplingParams
    from asyncllm.kernels import triton_moe
    from checkpoints import random_prompts, reference_greedy

    calls = []
    original = triton_moe.fused_experts
    monkeypatch.setattr(triton_moe, "fused_experts", lambda *a, **k: calls.append(1) or original(*a, **k))
    model_dir = model_dir_factory("qwen3_moe")
    prompts = random_prompts("qwen3_moe", [3, 12])
    expected = reference_greedy(model_dir, prompts, 6)
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", device=str(DEVICE), block_size=4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                                  ignore_eos=True))]
    assert got == expected and calls


# ---- compiled for real GPUs, without one ---------------------------------------------------------------

def _compile_all() -> None:
    """One JSON line per specialisation compiled for sm_90 (a Qwen3-30B-A3B-shaped layer: H 2048, I 768)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from asyncllm.kernels import triton_moe as tm
    from compile_kernels import launch_specialisation

    def compile_kernel(name, fn, pointers, constexprs, ints):
        constexprs, attrs = launch_specialisation(fn, pointers, ints, constexprs)
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
        for a in ("alpha", "limit"):
            if a in signature:
                signature[a] = "fp32"
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4})
        print(json.dumps({"kernel": name, "shared": kernel.metadata.shared}), flush=True)

    for dtype, activation, bias, on_input in [("bf16", 0, False, False), ("fp32", 0, False, True),
                                              ("bf16", 1, True, False)]:
        common = dict(pair_map_ptr="*i64", block_expert_ptr="*i32", pair_weight_ptr="*fp32")
        flags = dict(UPCAST=False, IEEE_DOT=dtype == "fp32", BLOCK_M=tm.BLOCK_M, BLOCK_K=32)
        compile_kernel(f"moe gate_up {dtype} act{activation}", tm._gate_up_kernel,
                       dict(common, x_ptr=f"*{dtype}", w13_ptr=f"*{dtype}", b13_ptr=f"*{dtype}", h_ptr=f"*{dtype}"),
                       dict(flags, HAS_BIAS=bias, ACTIVATION=activation, ON_INPUT=on_input, BLOCK_N=64),
                       dict(H=2048, I=768, top_k=8, stride_x=2048, stride_we=1536 * 2048, stride_wn=2048,
                            stride_be=1536, stride_h=768))
        compile_kernel(f"moe down {dtype}", tm._down_kernel,
                       dict(common, h_ptr=f"*{dtype}", w2_ptr=f"*{dtype}", b2_ptr=f"*{dtype}", out_ptr="*fp32"),
                       dict(flags, HAS_BIAS=bias, ON_INPUT=on_input, BLOCK_N=64),
                       dict(H=2048, I=768, stride_h=768, stride_we=2048 * 768, stride_wn=768, stride_be=2048,
                            stride_out=2048))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the kernels are compiled and run by the tests above")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(kernels) == 6
    assert all(k["shared"] <= 227 * 1024 for k in kernels), kernels


if __name__ == "__main__":
    _compile_all()

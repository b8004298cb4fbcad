"""The CPU C kernel of the routed experts (``kernels/cpu_moe.py``, ``csrc/moe_experts.c``) against
``grouped_experts`` / ``reference_experts`` of model/moe.py: both activations, biases, weights on the input,
expert-parallel slices, empty experts, thread counts, the AVX2 and portable builds, the cases that fall back to
torch, and a whole Qwen3-MoE model greedy-equal to transformers with the kernel running."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.kernels import cpu_build
from asyncllm.kernels import cpu_moe
from asyncllm.model.moe import expert_activation, grouped_experts, reference_experts, route
from asyncllm.model.shape import MoEShape
from checkpoints import random_prompts, reference_greedy

needs_c_kernel = pytest.mark.skipif(not cpu_moe.cpu_kernel_available(), reason="the MoE C kernel cannot be built here")
TOKENS = [1, 3, 32, 100]
HIDDEN, INTER = 48, 32  # multiples of 16, not of the AVX-512 tiles' 16 x 4 tokens


def _experts(experts: int, bias: bool, seed: int = 0, hidden: int = HIDDEN, inter: int = INTER):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    b13 = torch.randn(experts, 2 * inter, generator=gen) if bias else None
    b2 = torch.randn(experts, hidden, generator=gen) if bias else None
    return w13, w2, b13, b2


def _routing(tokens: int, experts: int, moe: MoEShape, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen) * 3  # large enough to reach the clamped activation's limits
    weights, ids = route(torch.randn(tokens, experts, generator=gen), moe)
    return x, weights, ids


def _close(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_c_kernel
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("experts,top_k", [(4, 1), (4, 2), (64, 1), (64, 2), (64, 8)])
def test_kernel_equals_grouped_experts(experts, top_k, activation):
    moe = MoEShape(num_experts=experts, top_k=top_k, intermediate_size=INTER, activation=activation,
                   swiglu_limit=2.0)
    act = expert_activation(moe)
    kind = cpu_moe.ACTIVATIONS[activation]
    for bias in (False, True):
        w13, w2, b13, b2 = _experts(experts, bias, seed=experts + top_k)
        for tokens in TOKENS:
            x, weights, ids = _routing(tokens, experts, moe, seed=tokens)
            for on_input in (False, True):
                got = cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2, kind, 0, b13, b2, on_input,
                                              moe.swiglu_alpha, moe.swiglu_limit)
                expected = grouped_experts(x, weights, ids, w13, w2, act, 0, b13, b2, on_input)
                _close(got, expected)
                if tokens <= 3:  # transformers' per-token loop too
                    _close(got, reference_experts(x, weights, ids, w13, w2, act, b13, b2, on_input))


@needs_c_kernel
@pytest.mark.parametrize("first,local", [(0, 16), (16, 16), (48, 16), (8, 40)])
def test_expert_parallel_slice_skips_other_ranks_experts(first, local):
    """Experts first .. first + local of 64: ids outside are another rank's; a token with none of this rank's
    experts gets a zero row."""
    moe = MoEShape(num_experts=64, top_k=8, intermediate_size=INTER)
    w13, w2, b13, b2 = _experts(64, True, seed=first)
    act = expert_activation(moe)
    for tokens in TOKENS:
        x, weights, ids = _routing(tokens, 64, moe, seed=tokens + first)
        ids[0] = torch.arange(8) + (first + local) % 64  # token 0: no local expert at all
        piece = slice(first, first + local)
        got = cpu_moe.moe_experts_cpu(x, weights, ids, w13[piece].contiguous(), w2[piece].contiguous(),
                                      cpu_moe.SILU, first, b13[piece].contiguous(), b2[piece].contiguous())
        expected = grouped_experts(x, weights, ids, w13[piece], w2[piece], act, first, b13[piece], b2[piece])
        _close(got, expected)
        assert torch.equal(got[0], torch.zeros(HIDDEN))


@needs_c_kernel
def test_empty_experts_tokens_and_steps():
    moe = MoEShape(num_experts=8, top_k=2, intermediate_size=INTER)
    w13, w2, _, _ = _experts(8, False)
    x, weights, ids = _routing(5, 8, moe)
    ids[:] = torch.tensor([3, 6])  # every token on experts 3 and 6: the other six get no tokens
    _close(cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2),
           grouped_experts(x, weights, ids, w13, w2, expert_activation(moe)))
    assert torch.equal(cpu_moe.moe_experts_cpu(x, weights, ids + 8, w13, w2), torch.zeros(5, HIDDEN))  # none local
    empty = cpu_moe.moe_experts_cpu(x[:0], weights[:0], ids[:0], w13, w2)
    assert empty.shape == (0, HIDDEN)


@needs_c_kernel
def test_a_long_prefill_goes_in_blocks_of_tokens():
    """1030 tokens x 8 pairs of 2 x 512 floats overflow the 32 MiB pair buffer: two blocks (1024 + 6 tokens)."""
    moe = MoEShape(num_experts=8, top_k=8, intermediate_size=512)
    gen = torch.Generator().manual_seed(4)
    w13, w2 = torch.randn(8, 1024, 16, generator=gen) / 4, torch.randn(8, 16, 512, generator=gen) / 22
    x = torch.randn(1030, 16, generator=gen)
    weights, ids = route(torch.randn(1030, 8, generator=gen), moe)
    _close(cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2), grouped_experts(x, weights, ids, w13, w2,
                                                                              expert_activation(moe)))


@needs_c_kernel
def test_strided_inputs_and_thread_counts_give_the_same_bits():
    """Each output element is summed by one thread in one order, so the thread count changes no bit; a strided
    x (a column slice), int32 ids and float64 weights are taken as well."""
    moe = MoEShape(num_experts=16, top_k=4, intermediate_size=INTER)
    w13, w2, b13, b2 = _experts(16, True, hidden=64, inter=48)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 80, generator=gen)
    weights, ids = route(torch.randn(37, 16, generator=gen), moe)
    x = wide[:, 8:72]
    results = [cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2, cpu_moe.SILU, 0, b13, b2, num_threads=n)
               for n in (1, 2, 3, 8)]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    _close(results[0], grouped_experts(x, weights, ids, w13, w2, expert_activation(moe), 0, b13, b2))
    assert torch.equal(cpu_moe.moe_experts_cpu(x.contiguous(), weights.double(), ids.int(), w13, w2, cpu_moe.SILU, 0,
                                               b13, b2, num_threads=1), results[0])


@needs_c_kernel
def test_fallbacks_return_none(monkeypatch):
    """Where the kernel does not run, the caller takes the torch path."""
    moe = MoEShape(num_experts=4, top_k=2, intermediate_size=INTER)
    w13, w2, b13, b2 = _experts(4, True)
    x, weights, ids = _routing(3, 4, moe)
    assert cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2) is not None
    assert cpu_moe.moe_experts_cpu(x.double(), weights, ids, w13, w2) is None            # not float32
    assert cpu_moe.moe_experts_cpu(x, weights, ids, w13.double(), w2) is None            # weights not float32
    assert cpu_moe.moe_experts_cpu(x.to("meta"), weights, ids, w13, w2) is None          # not on CPU
    assert cpu_moe.moe_experts_cpu(x, weights, ids, w13.transpose(1, 2).contiguous().transpose(1, 2), w2) is None
    assert cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2, b13=b13[:, ::2]) is None   # wrong shape of bias
    assert cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2, activation=7) is None
    odd_h, odd_i = _experts(4, False, hidden=40), _experts(4, False, inter=24)
    assert cpu_moe.moe_experts_cpu(torch.randn(3, 40), weights, ids, *odd_h[:2]) is None  # H not a multiple of 16
    assert cpu_moe.moe_experts_cpu(x, weights, ids, *odd_i[:2]) is None                   # I not a multiple of 16
    with torch.enable_grad():
        assert cpu_moe.moe_experts_cpu(x, weights, ids, w13.requires_grad_(), w2) is None  # autograd recording
    w13.requires_grad_(False)
    monkeypatch.setenv(cpu_build.ENV_SWITCH, "0")
    cpu_build.load_library.cache_clear()
    try:
        assert cpu_moe.moe_experts_cpu(x, weights, ids, torch.randn(4, 64, 48), torch.randn(4, 48, 32)) is None
    finally:
        monkeypatch.delenv(cpu_build.ENV_SWITCH)
        cpu_build.load_library.cache_clear()


@needs_c_kernel
def test_cached_pointers_follow_replaced_data():
    """``param.data = ...`` keeps the Parameter object but moves its memory: the kernel must read the new one."""
    moe = MoEShape(num_experts=4, top_k=2, intermediate_size=INTER)
    w13, w2, _, _ = _experts(4, False)
    w13, w2 = torch.nn.Parameter(w13, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)
    x, weights, ids = _routing(6, 4, moe)
    first = cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2)
    w13.data = w13.data * 2
    second = cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2)
    _close(second, grouped_experts(x, weights, ids, w13, w2, expert_activation(moe)))
    assert not torch.equal(first, second)


@pytest.mark.parametrize("build", ["no-avx512", "scalar"])
def test_other_builds_match_grouped_experts(tmp_path, build):
    """The AVX2 tiles (machines without AVX-512) and the portable loops, each built here whatever this machine has."""
    flags = (["-O2", "-fopenmp", "-mno-avx2", "-mno-fma", "-shared", "-fPIC"] if build == "scalar"
             else [*cpu_build._FLAGS, "-mno-avx512f"])
    try:
        lib = cpu_build.build_variant("moe_experts", flags, tmp_path / "moe_build.so", cpu_moe._SIGNATURES)
    except cpu_build.BuildError as e:
        pytest.skip(str(e))
    cpu_flags = cpu_build._cpu_flags().split()
    if build == "scalar":
        assert lib.moe_experts_isa() == 0
    elif "avx2" in cpu_flags and "fma" in cpu_flags:
        assert lib.moe_experts_isa() == 1
    else:
        pytest.skip("this machine cannot run the AVX2 build")
    for activation in ("silu", "swiglu_clamped"):
        moe = MoEShape(num_experts=16, top_k=4, intermediate_size=INTER, activation=activation, swiglu_limit=2.0)
        w13, w2, b13, b2 = _experts(16, True, seed=5)
        for tokens in (1, 3, 13):
            x, weights, ids = _routing(tokens, 16, moe, seed=tokens)
            for on_input in (False, True):
                got = cpu_moe.moe_experts_cpu(x, weights, ids, w13, w2, cpu_moe.ACTIVATIONS[activation], 0, b13, b2,
                                              on_input, moe.swiglu_alpha, moe.swiglu_limit, num_threads=2, lib=lib)
                _close(got, grouped_experts(x, weights, ids, w13, w2, expert_activation(moe), 0, b13, b2, on_input))


# ---- a whole model --------------------------------------------------------------------------------------------

@needs_c_kernel
@pytest.mark.parametrize("router,top_k,renormalize,bias", [
    ("softmax_topk", 8, True, False), ("softmax_topk", 2, False, False), ("softmax_topk", 1, True, False),
    ("topk_softmax", 4, False, True), ("topk_softmax", 1, False, False)])
def test_routing_kernel_equals_route(router, top_k, renormalize, bias):
    """The C router picks the experts torch's route() picks, with the same weights (float32 rounding aside)."""
    torch.manual_seed(5)
    tokens, hidden, experts = 33, 96, 64
    moe = MoEShape(num_experts=experts, top_k=top_k, intermediate_size=32, router=router, renormalize=renormalize,
                   router_bias=bias)
    x, w = torch.randn(tokens, hidden), torch.randn(experts, hidden) * 0.3
    b = torch.randn(experts) if bias else None
    weights, ids = cpu_moe.route_cpu(x, w, b, moe)
    expected_weights, expected_ids = route(torch.nn.functional.linear(x, w, b), moe)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    assert ids.dtype is torch.int64 and weights.dtype is torch.float32
    # what it leaves to torch: grouped or corrected choices, scaled weights, sigmoid routers, other dtypes
    assert cpu_moe.route_cpu(x, w, b, MoEShape(num_experts=experts, top_k=top_k, intermediate_size=32,
                                                router="sigmoid_topk")) is None
    assert cpu_moe.route_cpu(x, w, b, MoEShape(num_experts=experts, top_k=top_k, intermediate_size=32,
                                                router=router, routed_scaling=2.5)) is None
    assert cpu_moe.route_cpu(x.double(), w.double(), None, moe) is None


def test_qwen3_moe_with_the_kernel_equals_transformers(model_dir_factory, monkeypatch):
    model_dir = model_dir_factory("qwen3_moe")
    prompts = random_prompts("qwen3_moe", [1, 5, 9, 17, 40])
    expected = reference_greedy(model_dir, prompts, 20)
    calls = []

    def counted(*args):
        out = stack(*args)
        calls.append(out is not None)
        return out

    stack = cpu_moe.stack_experts_cpu
    monkeypatch.setattr(cpu_moe, "stack_experts_cpu", counted)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for engine_kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 16}):  # whole and chunked prefill
        calls.clear()
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert got == expected, engine_kwargs
        assert calls and all(calls)  # every sparse layer of every step went through the kernel
        assert llm.stats()["kv_blocks_used"] == 0


@needs_c_kernel
def test_microbenchmark_runs(tmp_path):
    import json
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # benchmarks/ lives at the repository root
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import moe_experts

    out = tmp_path / "moe.json"
    report = moe_experts.main(["--tiny", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [r["tokens"] for r in report["results"]] == [1, 8]
    for r in report["results"]:
        assert r["torch_ms"] > 0 and r["kernel_ms"] > 0 and r["speedup"] == pytest.approx(r["torch_ms"] / r["kernel_ms"])

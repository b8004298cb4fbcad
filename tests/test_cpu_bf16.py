"""dtype="bfloat16" on CPU (platform.py ``bf16_weights``): bf16-rounded weights, read as paired bf16 panels by the
decode stack and the LM head on AVX-512 builds. Decode steps of fewer than ``bf16_dot_rows()`` rows run float32
arithmetic on them, so they equal transformers computing in float32 on the same rounded weights token for token;
larger decode steps (AVX512-BF16 builds) and prefill matmuls (where oneDNN has native bf16) round the activations
to bf16, checked against that float32 computation within a tolerance. On builds without AVX-512 the older bf16
path (torch in bfloat16 throughout) runs instead."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.kernels.cpu_decode_stack import amx_calls, amx_rows, bf16_dot_rows, pair_panels_bf16, panels_supported, set_amx_rows
from asyncllm.kernels.cpu_panel_linear import PanelEmbedding, PanelLinear
from checkpoints import load_reference_model, random_prompts, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _rounded_reference(model_dir):
    model = load_reference_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))  # bf16 values, float32 arithmetic
    return model


def _count_calls(monkeypatch, cls, name: str) -> list:
    """A list that grows by one at every call of ``cls.name`` (which still runs) while ``monkeypatch`` holds."""
    calls, method = [], getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *a: (calls.append(1), method(self, *a))[1])
    return calls


def _one_token_prompts() -> list[list[int]]:
    return [[t] for t in (17, 250, 731)]  # one-token prompts: every step is decode-shaped (the decode stack's)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head; tied Qwen2 with q/k/v biases
def test_decode_steps_equal_float32_on_rounded_weights(model_dirs, kind):
    """Decode steps run float32 arithmetic on the bf16 weights: token for token transformers' float32 on the same
    rounded weights (one-token prompts, so every step of three sequences goes through the decode stack)."""
    model_dir = model_dirs[kind]
    prompts = _one_token_prompts()
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens, model=_rounded_reference(model_dir))
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype="float32")  # float32 cache: exact (the default: bf16)
    runner = llm.engine.runner
    calls = []
    if runner.decode_stack is not None:
        run = runner.decode_stack.run
        runner.decode_stack.run = lambda *a, **k: (calls.append(1), run(*a, **k))[1]
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if panels_supported():
        assert runner.bf16_weights and runner.dtype == torch.float32 and len(calls) >= GREEDY.max_tokens
        assert runner.decode_stack.weights == "bfloat16"
        assert all(t.dtype == torch.bfloat16 for t in runner.decode_stack._keep if t.dim() == 3)  # the panels
        assert len(prompts) < bf16_dot_rows() or not bf16_dot_rows()  # float32 activations: exact
        assert runner.kv_caches[0][0].dtype == torch.float32
        head = runner.model.lm_head
        assert isinstance(head, PanelLinear) and head.panels.dtype == torch.bfloat16
    else:  # no AVX-512: torch in bfloat16 throughout (the older path), no decode stack
        assert not runner.bf16_weights and runner.dtype == torch.bfloat16 and runner.decode_stack is None


@pytest.mark.skipif(not panels_supported(), reason="the bf16-weight path is an AVX-512 build's (checked above)")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prefill_in_bf16_stays_close_to_float32_on_rounded_weights(model_dirs, kind):
    """Prefill matmuls round their inputs to bf16 where oneDNN runs bf16 natively: within a tolerance of the
    float32 computation on the same rounded weights (prompt logprobs), the first token always the same."""
    from asyncllm.kernels.cpu_linear import PackedLinear

    model_dir = model_dirs[kind]
    reference = _rounded_reference(model_dir)
    prompts = random_prompts(f"bf16-{kind}", [5, 17, 40, 64])
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens, model=reference)
    llm = LLM(str(model_dir), dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [t[0] for t in tokens] == [e[0] for e in expected]
    agree = sum(a == b for t, e in zip(tokens, expected) for a, b in zip(t, e)) / sum(map(len, expected))
    assert agree >= 0.75, agree
    diffs = []
    with torch.no_grad():
        for out, prompt in zip(outputs, prompts):
            ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
            diffs += [abs(out.prompt_logprobs[i][prompt[i]] - float(ref[i - 1, prompt[i]])) for i in range(1, len(prompt))]
    assert sum(diffs) / len(diffs) < 0.25 and max(diffs) < 2.0, (sum(diffs) / len(diffs), max(diffs))
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    native = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    assert packed and all(m.compute_dtype == (torch.bfloat16 if native else None) for m in packed)
    # with native bf16 matmuls the MLPs keep their activations bf16 from gate_up to down (model/mlp.py)
    assert all(layer.mlp._bf16_matmuls() == native for layer in llm.engine.runner.model.model.layers)


def test_the_torch_reference_stays_plain_bfloat16(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="bfloat16", attention_backend="torch")
    runner = llm.engine.runner
    assert not runner.bf16_weights and runner.dtype == torch.bfloat16
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.skipif(not panels_supported(), reason="bf16 panels are an AVX-512 build's (checked above otherwise)")
@pytest.mark.parametrize("rows", [1, 5, 7, 8, 12, 33])
@pytest.mark.parametrize("width", [64, 63])  # 63: an odd width, the last pair half padding
def test_bf16_panel_head_against_float32_on_rounded_weights(rows, width):
    """Below bf16_dot_rows() rows: exactly the float32 panels' FMAs on the rounded weights. From there (AVX512-BF16
    builds): bf16 dot products, equal to float32 arithmetic on bf16-rounded activations up to summation order,
    and within bf16's rounding of the float32 result."""
    torch.manual_seed(rows)
    weight = torch.randn(100, width).to(torch.bfloat16).float()  # 100: a partial last panel
    x = torch.randn(rows, width)
    f32, bf16 = PanelLinear(weight), PanelLinear(weight, bf16=True)
    assert bf16.panels.dtype == torch.bfloat16 and bf16.panels.nbytes * 2 == f32.panels.nbytes + 4 * 32 * 4 * (width % 2)  # 4 panels: a padding row each
    assert torch.equal(bf16.weight, weight)
    if not bf16_dot_rows() or rows < bf16_dot_rows():
        torch.testing.assert_close(bf16(x), f32(x), rtol=0, atol=0)  # the same float32 FMAs in the same order
        torch.testing.assert_close(bf16(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    else:
        rounded = x.to(torch.bfloat16).float() @ weight.T
        torch.testing.assert_close(bf16(x), rounded, rtol=1e-5, atol=1e-4)
        assert not torch.equal(bf16(x), f32(x))  # the activations were rounded
        torch.testing.assert_close(bf16(x), x @ weight.T, rtol=0.02, atol=0.15)


@pytest.mark.skipif(not amx_rows(), reason="AMX tiles need an AMX-BF16 build and the OS's grant of the tile state")
@pytest.mark.parametrize("rows", [8, 16, 17, 33, 64])
@pytest.mark.parametrize("width", [64, 96, 70])  # 70: 35 pairs, not whole tiles (the vdpbf16ps tiles instead)
def test_amx_tiles_equal_bf16_dot_products_up_to_summation_order(rows, width):
    """From amx_rows() rows the bf16 panels multiply in AMX tiles (rows padded to whole tiles of 16): float32
    arithmetic on bf16-rounded activations and weights up to summation order, like the vdpbf16ps tiles."""
    torch.manual_seed(rows * width)
    weight = torch.randn(100, width).to(torch.bfloat16).float()
    x = torch.randn(rows, width)
    head = PanelLinear(weight, bf16=True)
    calls = amx_calls()
    tiles = head(x)
    assert (amx_calls() > calls) == (rows >= amx_rows() and width != 70)
    before = amx_rows()
    set_amx_rows(0)
    try:
        assert amx_rows() == 0
        calls = amx_calls()
        dots = head(x)
        assert amx_calls() == calls
    finally:
        assert set_amx_rows(before) == before
    rounded = x.to(torch.bfloat16).float() @ weight.T
    torch.testing.assert_close(tiles, rounded, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tiles, dots, rtol=1e-5, atol=1e-4)
    if width == 70:
        assert torch.equal(tiles, dots)


def test_amx_threshold_switches_off_and_back():
    before = amx_rows()
    assert set_amx_rows(0) == 0 and amx_rows() == 0
    assert set_amx_rows(before) == before == amx_rows()
    if before:
        assert set_amx_rows(1) == bf16_dot_rows()  # never below the rows that have bf16 activations
        set_amx_rows(before)


def test_paired_panels_hold_each_weight_pair_side_by_side():
    weight = torch.arange(40 * 5, dtype=torch.float32).reshape(40, 5)  # small integers: exact in bf16
    panels = pair_panels_bf16(weight)
    assert panels.shape == (2, 3, 64) and panels.dtype == torch.bfloat16
    assert panels[1, 1, 2 * 3].item() == weight[35, 2] and panels[1, 1, 2 * 3 + 1].item() == weight[35, 3]
    assert panels[0, 2, 1].item() == 0 and panels[1, 0, 2 * 8].item() == 0  # past K, past N
    embedding = PanelEmbedding(PanelLinear(weight, bf16=True))
    assert torch.equal(embedding(torch.tensor([[35, 0], [39, 7]])), weight[torch.tensor([[35, 0], [39, 7]])])


@pytest.fixture
def amx_off():
    """AMX tiles switched off for one test (the vdpbf16ps tiles instead), back on after it."""
    before = amx_rows()
    set_amx_rows(0)
    yield
    set_amx_rows(before)


@pytest.mark.skipif(not bf16_dot_rows(), reason="bf16 dot products are an AVX512-BF16 build's")
@pytest.mark.parametrize("tiles", ["amx", "vdpbf16ps"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_many_row_decode_steps_in_bf16_dot_products_stay_close_to_float32(model_dirs, kind, tiles, request):
    """Decode steps of bf16_dot_rows() rows and more multiply bf16 activations: every sequence's log-probabilities
    within a tolerance of transformers' float32 on the rounded weights, most greedy tokens the same, and the
    steps went through the decode stack's dot-product path (with as many rows). Once in AMX tiles (where the
    build and the OS have them; the toy models' widths are whole tiles), once in vdpbf16ps tiles."""
    if tiles == "amx" and not amx_rows():
        pytest.skip("AMX tiles need an AMX-BF16 build and the OS's grant of the tile state")
    if tiles == "vdpbf16ps":
        request.getfixturevalue("amx_off")
    assert not amx_rows() or amx_rows() <= 12  # 12 rows below take the tiles when they are on
    calls = amx_calls()
    model_dir = model_dirs[kind]
    prompts = [[t] for t in range(17, 17 + 7 * 12, 7)]  # 12 one-token prompts: decode steps of 12 rows
    reference = _rounded_reference(model_dir)
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens, model=reference)
    llm = LLM(str(model_dir), dtype="bfloat16")
    runner = llm.engine.runner
    rows = []
    run = runner.decode_stack.run
    runner.decode_stack.run = lambda ids, *a, **k: (rows.append(ids.shape[0]), run(ids, *a, **k))[1]
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    assert max(rows) == len(prompts) >= bf16_dot_rows()
    assert (amx_calls() > calls) == (tiles == "amx")
    tokens = [o.outputs[0].token_ids for o in outputs]
    agree = sum(a == b for t, e in zip(tokens, expected) for a, b in zip(t, e)) / sum(map(len, expected))
    assert agree >= 0.75, agree
    diffs = []
    with torch.no_grad():
        for out, prompt in zip(outputs, prompts):
            ids = prompt + out.outputs[0].token_ids
            ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
            for i, token in enumerate(out.outputs[0].token_ids[1:], start=1):  # the decode steps' tokens
                diffs.append(abs(out.outputs[0].logprobs[i][token] - float(ref[len(prompt) - 1 + i, token])))
    assert sum(diffs) / len(diffs) < 0.25 and max(diffs) < 2.0, (sum(diffs) / len(diffs), max(diffs))


def _config(stored: str | None, quantized: bool = False):
    from types import SimpleNamespace

    return SimpleNamespace(dtype=stored, quantization_config={"quant_method": "gptq"} if quantized else None)


def test_auto_dtype_on_cpu_picks_bfloat16_only_for_16_bit_checkpoints_where_bf16_is_native():
    from asyncllm.platform import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", _config("bfloat16"), cpu, native_bf16_cpu=True) == torch.bfloat16
    assert resolve_dtype("auto", _config("float16"), cpu, native_bf16_cpu=True) == torch.bfloat16
    assert resolve_dtype("auto", _config("float32"), cpu, native_bf16_cpu=True) == torch.float32  # kept exact
    assert resolve_dtype("auto", _config(None), cpu, native_bf16_cpu=True) == torch.float32
    assert resolve_dtype("auto", _config("float16", quantized=True), cpu, native_bf16_cpu=True) == torch.float32
    assert resolve_dtype("auto", _config("bfloat16"), cpu, native_bf16_cpu=False) == torch.float32
    assert resolve_dtype("float32", _config("bfloat16"), cpu, native_bf16_cpu=True) == torch.float32


def test_a_bfloat16_checkpoint_loads_as_bf16_weights_by_default_where_native(model_dirs, tmp_path):
    """A checkpoint saved in bfloat16 with dtype left "auto": on AVX512-BF16 builds the bf16 panel path (as
    dtype="bfloat16" would), elsewhere float32; the torch reference and a float32 checkpoint stay float32."""
    import json
    import shutil

    source = model_dirs["llama"]
    half = tmp_path / "llama-bf16"
    shutil.copytree(source, half)
    model = load_reference_model(source).to(torch.bfloat16)
    model.save_pretrained(half)
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    runner = LLM(str(half)).engine.runner
    assert runner.bf16_weights == bool(bf16_dot_rows()) and runner.dtype == torch.float32
    assert not LLM(str(half), attention_backend="torch").engine.runner.bf16_weights
    assert not LLM(str(source)).engine.runner.bf16_weights


@pytest.mark.skipif(not panels_supported(), reason="dtype='bfloat16' on CPU is the AVX-512 builds' path")
def test_int8_weights_under_bfloat16_multiply_in_bf16_dot_products(model_dirs):
    """dtype="bfloat16" on int8 weights: the weights stay int8, every int8 layer takes bf16 dot products for calls of
    13+ rows where the build has them (prefill here), within a tolerance of the float32-activation int8 engine;
    decode steps of a few rows keep the int8 decode stack."""
    from asyncllm.kernels.int8_linear import Int8Linear, bf16_dot_available

    model_dir = model_dirs["llama"]
    prompts = random_prompts("bf16-int8", [5, 17, 40, 64])
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, prompt_logprobs=0)
    exact = LLM(str(model_dir), quantization="int8")
    expected = exact.generate(prompts, params)
    fast = LLM(str(model_dir), quantization="int8", dtype="bfloat16")
    layers = [m for m in fast.engine.runner.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.bf16_dot == bf16_dot_available() for m in layers)
    assert not any(m.bf16_dot for m in exact.engine.runner.model.modules() if isinstance(m, Int8Linear))
    assert fast.engine.runner.decode_stack is not None and fast.engine.runner.decode_stack.weights == "int8"
    outputs = fast.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    reference = [o.outputs[0].token_ids for o in expected]
    assert [t[0] for t in tokens] == [e[0] for e in reference]
    agree = sum(a == b for t, e in zip(tokens, reference) for a, b in zip(t, e)) / sum(map(len, reference))
    assert agree >= 0.75, agree
    diffs = [abs(out.prompt_logprobs[i][p[i]] - ref.prompt_logprobs[i][p[i]])
             for out, ref, p in zip(outputs, expected, prompts) for i in range(1, len(p))]
    assert sum(diffs) / len(diffs) < 0.25 and max(diffs) < 2.0, (sum(diffs) / len(diffs), max(diffs))
    if bf16_dot_available():  # the 64-token prompt's prefill went through the bf16 products: not the same bits
        assert any(d > 0 for d in diffs)


@pytest.mark.skipif(not panels_supported(), reason="the bf16-weight path is an AVX-512 build's")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2's q/k/v biases keep the float32 path
def test_bf16_prefill_attention_equals_the_float32_attention_path(model_dirs, kind, monkeypatch):
    """Where prefill SDPA runs in bf16 (AMX CPUs; forced here), a plain layer keeps q, k, v bf16 from the qkv
    matmul to the o projection: the same prompt logprobs and tokens, bit for bit, as the float32 path that
    converts in between."""
    from asyncllm.kernels import cpu_attention
    from asyncllm.model.decoder import Attention

    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: True)
    native = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    prompts = random_prompts(f"bf16-attn-{kind}", [5, 17, 17, 40, 64])  # two of one shape: one SDPA call
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    calls = _count_calls(monkeypatch, Attention, "_forward_bf16_prefill")
    results = {}
    for on in (True, False):
        monkeypatch.setattr(Attention, "bf16_prefill", on)
        llm = LLM(str(model_dirs[kind]), dtype="bfloat16")
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
        outputs = llm.generate(prompts, params)
        results[on] = [(o.outputs[0].token_ids, o.prompt_logprobs[1:]) for o in outputs]
        llm.close()
        if on:
            taken = len(calls)
    assert results[True] == results[False]
    if kind == "llama" and native:
        assert taken > 0 and len(calls) == taken  # the fused path ran only while switched on
    else:
        assert taken == 0


@pytest.mark.skipif(not panels_supported(), reason="the bf16-weight path is an AVX-512 build's")
@pytest.mark.parametrize("amx", [True, False], ids=["bf16-sdpa", "c-kernel"])
def test_bf16_residual_layers_equal_converting_around_each_norm(model_dir_factory, amx, monkeypatch):
    """A prefill-only step whose layers all keep q, k, v bf16 runs whole layers between the float32 residual and bf16
    activations (norms adding bf16 projection outputs and rounding their own): the same prompt logprobs and tokens,
    bit for bit, as the layers that convert around each norm (DecoderLayer.bf16_residual = False)."""
    from asyncllm.kernels import cpu_attention, cpu_prefill_attention
    from asyncllm.model.decoder import DecoderLayer

    if not bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()):
        pytest.skip("oneDNN has no native bf16 here: the projections stay float32")
    if not amx and not cpu_prefill_attention.available():
        pytest.skip("the C prefill attention kernel needs AVX512-BF16")
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: amx)
    model_dir = model_dir_factory("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts("bf16-residual", [5, 17, 17, 40, 64])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    calls = _count_calls(monkeypatch, DecoderLayer, "forward_bf16_residual")
    results = {}
    for on in (True, False):
        monkeypatch.setattr(DecoderLayer, "bf16_residual", on)
        calls.clear()
        llm = LLM(str(model_dir), dtype="bfloat16")
        outputs = llm.generate(prompts, params)
        results[on] = [(o.outputs[0].token_ids, o.prompt_logprobs[1:]) for o in outputs]
        llm.close()
        assert bool(calls) == on  # the prefill step took the path only while switched on
    assert results[True] == results[False]


@pytest.mark.skipif(not panels_supported(), reason="the bf16-weight path is an AVX-512 build's")
def test_bf16_prefill_layers_through_the_c_kernel_without_amx(model_dir_factory, monkeypatch):
    """Without AMX, a prefill-only step whose chunks all attend to themselves keeps q, k, v bf16 and attends through
    the C kernel's bf16 variant (the numbers of bf16 SDPA): against the float32 query (ASYNCLLM_BF16_ATTENTION=0),
    the same first tokens and prompt logprobs within bf16 attention's rounding."""
    from asyncllm.kernels import cpu_attention, cpu_prefill_attention
    from asyncllm.model.decoder import Attention

    if not cpu_prefill_attention.available():
        pytest.skip("the C prefill attention kernel needs AVX512-BF16")
    monkeypatch.setattr(cpu_attention, "amx_attention", lambda: False)
    prompts = random_prompts("bf16-kernel-attn", [5, 17, 17, 40, 64])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    calls = _count_calls(monkeypatch, Attention, "_forward_bf16_prefill")
    results = {}
    real = cpu_prefill_attention.prefill_attention
    for way in ("kernel", "float32-query", "bf16-sdpa"):
        monkeypatch.setenv("ASYNCLLM_BF16_ATTENTION", "0" if way == "float32-query" else "")
        monkeypatch.setattr(cpu_attention, "amx_attention", lambda: way == "bf16-sdpa")
        calls.clear()
        kernel_calls = []
        monkeypatch.setattr(cpu_prefill_attention, "prefill_attention",
                            lambda q, *a: (kernel_calls.append(q.dtype), real(q, *a))[1])
        llm = LLM(str(model_dir_factory("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)),
                  dtype="bfloat16")  # head_dim 32: the kernel's smallest
        outputs = llm.generate(prompts, params)
        results[way] = [(o.outputs[0].token_ids, o.prompt_logprobs[1:], p) for o, p in zip(outputs, prompts)]
        llm.close()
        assert bool(calls) == (way != "float32-query")  # the bf16 layers ran for the prefill step
        assert (torch.bfloat16 in kernel_calls) == (way == "kernel")

    def diffs(a, b):
        return [abs(x[i][p[i + 1]] - y[i][p[i + 1]])
                for (_, x, p), (_, y, _) in zip(results[a], results[b]) for i in range(len(p) - 1)]

    first = {way: [t[0] for t, _, _ in results[way]] for way in results}
    assert first["kernel"] == first["bf16-sdpa"] == first["float32-query"]
    rounding, kernel = diffs("bf16-sdpa", "float32-query"), diffs("kernel", "float32-query")
    assert max(rounding) > 0 and max(kernel) > 0  # bf16 attention is not the float32 query's
    # the kernel strays from the float32 query no further than torch's bf16 SDPA does (this tiny model's scaled logits
    # magnify every rounding: ~0.1 nats on average for either)
    assert sum(kernel) <= 1.5 * sum(rounding) and max(kernel) <= 1.5 * max(rounding), (kernel, rounding)

"""The CPU path's oneDNN-packed linear layers: same results as nn.Linear, used by the engine on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm import LLM, SamplingParams
from asyncllm.kernels.cpu_decode_stack import panels_supported
from asyncllm.kernels.cpu_linear import ENV_SWITCH, PackedLinear, pack_linear_layers, packing_supported, row_bucket
from asyncllm.kernels.cpu_panel_linear import PanelLinear

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 33, 64, 257])  # 33 and 257 run padded to their row buckets
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(48, 80, bias=bias)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        # a strided input (a column slice) and a 3-d input
        wide = torch.randn(rows, 96)[:, :48]
        torch.testing.assert_close(packed(wide), F.linear(wide, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x.view(1, rows, 48)), linear(x).view(1, rows, 80), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight.detach())


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16), reason="no native bf16 oneDNN here")
@pytest.mark.parametrize("bias", [False, True])
def test_forward_as_takes_and_returns_bf16_without_changing_the_sums(bias):
    """A bf16 compute dtype: ``forward_as`` reads float32 or bf16 inputs and hands back the asked dtype; the same
    matmul either way (the input rounded once, the output rounded by oneDNN to bf16), the bias added in the output
    dtype."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 96, bias=bias)
    packed = PackedLinear.from_linear(linear, torch.bfloat16)
    x = torch.randn(40, 64)
    with torch.inference_mode():
        f32 = packed(x)
        assert f32.dtype == torch.float32
        from_bf16 = packed.forward_as(x.to(torch.bfloat16), torch.float32)
        torch.testing.assert_close(from_bf16, f32, rtol=0, atol=0)
        low = packed.forward_as(x, torch.bfloat16)
        assert low.dtype == torch.bfloat16
        # oneDNN's bf16 matmul hands back bf16 either way: the float32 output is that result widened
        if linear.bias is None:
            torch.testing.assert_close(f32, low.float(), rtol=0, atol=0)
        rounded = F.linear(x.to(torch.bfloat16).float(), linear.weight.to(torch.bfloat16).float(), linear.bias)
        torch.testing.assert_close(f32, rounded, rtol=8e-3, atol=8e-3)  # within a bf16 rounding of the result


def test_pack_linear_layers_replaces_every_linear_and_adds_extra_heads():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(16, 4)))
    embedding = torch.randn(32, 4)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    assert pack_linear_layers(model, extra={"head": embedding}) == 3
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(model[2](model[1](model[0](x))), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.head(expected), (expected @ embedding.T).detach(), rtol=1e-5, atol=1e-5)


def test_packing_is_cpu_float_only(monkeypatch):
    assert not packing_supported(torch.device("cpu"), torch.float16)
    assert not packing_supported(torch.device("meta"), torch.float32)
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not packing_supported(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied and tied LM heads
def test_engine_packs_its_projections_and_output_is_unchanged(kind, model_dirs, monkeypatch):
    prompts = [[5, 17, 42, 99, 3], [7] * 12, list(range(20, 45))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    packed_llm = LLM(str(model_dirs[kind]), dtype="float32")
    model = packed_llm.engine.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    # the LM head: float32 panels where the decode stack's kernel reads them (AVX-512), else oneDNN
    assert isinstance(model.lm_head, PanelLinear if panels_supported() else PackedLinear)
    packed_tokens = [o.outputs[0].token_ids for o in packed_llm.generate(prompts, params)]

    monkeypatch.setenv(ENV_SWITCH, "0")
    plain_llm = LLM(str(model_dirs[kind]), dtype="float32")
    assert isinstance(plain_llm.engine.runner.model.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    plain_tokens = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]
    assert packed_tokens == plain_tokens


def test_row_buckets_pad_little_and_stay_few():
    assert [row_bucket(r) for r in (1, 17, 32)] == [1, 17, 32]  # small calls run exact
    assert [row_bucket(r) for r in (33, 257, 513, 1025)] == [34, 272, 576, 1152]
    buckets = {row_bucket(r) for r in range(1, 2049)}
    assert len(buckets) <= 112  # row counts held per layer shape, well inside oneDNN's 1,024-entry cache
    for rows in range(1, 5000):
        bucket = row_bucket(rows)
        # under 1/16 padding up to 512 rows (a 257-row call once ran at 384), under 1/8 beyond
        assert rows <= bucket < rows * (1 + (1 / 16 if rows <= 512 else 1 / 8))
        assert row_bucket(bucket) == bucket


@pytest.mark.skipif(not panels_supported(), reason="the panel kernel needs an AVX-512 build")
@pytest.mark.parametrize("rows", [0, 1, 5, 12, 13, 40, 130])
def test_panel_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    weight = torch.randn(100, 72)  # 100 outputs: the last panel is padded
    layer = PanelLinear.build(weight)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(rows, 72)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert PanelLinear.build(weight.double()) is None
    with pytest.raises(ValueError, match="float32"):
        layer(x.double())

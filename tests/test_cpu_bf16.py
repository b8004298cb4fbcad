"""dtype="bfloat16" on CPU (platform.py ``bf16_weights``): float32 arithmetic on bf16-rounded weights, read as
bf16 panels by the decode stack and the LM head on AVX-512 builds. It must equal transformers computing in
float32 on the same bf16-rounded weights (the oracle the issue names), token for token; on builds without
AVX-512 the older bf16 path (torch in bfloat16 throughout) runs instead, and says so."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.kernels.cpu_decode_stack import panels_supported
from asyncllm.kernels.cpu_panel_linear import PanelLinear
from checkpoints import load_reference_model, random_prompts, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _rounded_reference(model_dir):
    model = load_reference_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))  # bf16 values, float32 arithmetic
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head with biases-free Llama; tied Qwen2 with q/k/v biases
def test_bfloat16_equals_float32_on_rounded_weights(model_dirs, kind):
    model_dir = model_dirs[kind]
    prompts = random_prompts(f"bf16-{kind}", [5, 17, 40])
    expected = reference_greedy(model_dir, prompts, GREEDY.max_tokens, model=_rounded_reference(model_dir))
    llm = LLM(str(model_dir), dtype="bfloat16")
    runner = llm.engine.runner
    outputs = llm.generate(prompts, GREEDY)  # three sequences: decode steps of 1-3 rows through the stack
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if panels_supported():
        assert runner.bf16_weights and runner.dtype == torch.float32
        assert runner.decode_stack is not None and runner.decode_stack.weights == "bfloat16"
        assert all(t.dtype == torch.bfloat16 for t in runner.decode_stack._keep if t.dim() == 3)  # the panels
        assert runner.kv_caches[0][0].dtype == torch.float32
        head = runner.model.lm_head
        assert isinstance(head, PanelLinear) and head.panels.dtype == torch.bfloat16
    else:  # no AVX-512: torch in bfloat16 throughout (the older path), no decode stack
        assert not runner.bf16_weights and runner.dtype == torch.bfloat16 and runner.decode_stack is None


def test_the_torch_reference_stays_plain_bfloat16(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="bfloat16", attention_backend="torch")
    runner = llm.engine.runner
    assert not runner.bf16_weights and runner.dtype == torch.bfloat16
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.skipif(not panels_supported(), reason="bf16 panels are an AVX-512 build's (checked above otherwise)")
@pytest.mark.parametrize("rows", [1, 5, 12, 33])
def test_bf16_panel_head_equals_the_float32_one_on_rounded_weights(rows):
    torch.manual_seed(rows)
    weight = torch.randn(100, 64).to(torch.bfloat16).float()  # 100: a partial last panel
    x = torch.randn(rows, 64)
    f32, bf16 = PanelLinear(weight), PanelLinear(weight, bf16=True)
    assert bf16.panels.dtype == torch.bfloat16 and bf16.panels.nbytes * 2 == f32.panels.nbytes
    torch.testing.assert_close(bf16(x), f32(x), rtol=0, atol=0)  # the same float32 FMAs in the same order
    torch.testing.assert_close(bf16(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(bf16.weight, weight)

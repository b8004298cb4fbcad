"""Quantized checkpoints, written as each format's tool writes them (asyncllm/toy/quantized.py), load with
their weights kept quantized, and greedy output equals transformers on the same dequantized weights token for
token (docs/quantization.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.toy import quantized as qc
from asyncllm import LLM, SamplingParams
from asyncllm.kernels.int8_linear import Int8Linear
from asyncllm.kernels.quant_linear import GROUP_QUANT_BF16_ROWS, Fp8Linear, GroupQuantLinear
from asyncllm.model.runner import _bf16_matmuls
from checkpoints import random_prompts, reference_greedy, strong_peft_adapter

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = random_prompts("quantized", [1, 6, 19, 33])

# (id, writer, its options, the module the projections run as)
FORMATS = [
    ("gptq-4bit-g32-sym", qc.write_gptq, dict(bits=4, group_size=32, sym=True), GroupQuantLinear),
    ("gptq-4bit-g32-actorder", qc.write_gptq, dict(bits=4, group_size=32, sym=True, desc_act=True), GroupQuantLinear),
    ("gptq-v2-4bit-g64-asym-actorder-legacy-file", qc.write_gptq,
     dict(bits=4, group_size=64, sym=False, desc_act=True, checkpoint_format="gptq_v2",
          config_location="quantize_config.json"), GroupQuantLinear),
    ("gptq-4bit-row-asym-v1", qc.write_gptq, dict(bits=4, group_size=-1, sym=False), GroupQuantLinear),
    ("gptq-8bit-g32-sym", qc.write_gptq, dict(bits=8, group_size=32, sym=True), Int8Linear),
    ("gptq-8bit-row-asym", qc.write_gptq, dict(bits=8, group_size=-1, sym=False), GroupQuantLinear),
    ("awq-g64", qc.write_awq, dict(group_size=64), GroupQuantLinear),
    ("awq-g32", qc.write_awq, dict(group_size=32), GroupQuantLinear),
    ("ct-w4a16", qc.write_compressed_tensors, dict(scheme="W4A16", group_size=32), GroupQuantLinear),
    ("ct-w4a16-asym", qc.write_compressed_tensors, dict(scheme="W4A16_ASYM", group_size=32), GroupQuantLinear),
    ("ct-w8a16", qc.write_compressed_tensors, dict(scheme="W8A16", group_size=32), Int8Linear),
    ("ct-w8a8", qc.write_compressed_tensors, dict(scheme="W8A8"), Int8Linear),
    ("ct-fp8-channel", qc.write_compressed_tensors, dict(scheme="FP8"), Fp8Linear),
    ("ct-fp8-tensor", qc.write_compressed_tensors, dict(scheme="FP8_TENSOR"), Fp8Linear),
    ("ct-fp8-block", qc.write_compressed_tensors, dict(scheme="FP8_BLOCK", block=(32, 32)), Fp8Linear),
    ("fp8-block-deepseek", qc.write_fp8_block, dict(block=(32, 32)), Fp8Linear),
    ("fp8-block-partial", qc.write_fp8_block, dict(block=(48, 40)), Fp8Linear),
]


@pytest.fixture(scope="module")
def source(model_dir_factory) -> Path:
    return model_dir_factory("llama")


def _projections(llm: LLM) -> list[torch.nn.Module]:
    model = llm.engine.runner.model
    return [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]


@pytest.mark.parametrize("case", FORMATS, ids=[f[0] for f in FORMATS])
def test_greedy_equals_transformers_on_the_dequantized_weights(source, tmp_path, case):
    _, writer, options, runs_as = case
    quantized = writer(source, tmp_path / "q", dst_dequant=tmp_path / "twin", **options)
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS)
    llm = LLM(str(quantized), dtype="float32", block_size=4)
    try:
        assert {type(m) for m in _projections(llm)} == {runs_as}  # kept quantized, never widened
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()
    assert got == expected


def test_the_layers_hold_the_checkpoints_bytes_not_floats(source, tmp_path):
    """4-bit projections take about half a byte per weight (plus the scales), as in the file."""
    quantized = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=False)
    llm = LLM(str(quantized), dtype="float32")
    try:
        layers = _projections(llm)
        held = sum(t.numel() * t.element_size() for m in layers for t in m.buffers())
        weights = sum(m.in_features * m.out_features for m in layers)
    finally:
        llm.close()
    stored = sum(t.numel() * t.element_size() for name, t in qc.read_tensors(quantized).items()
                 if ".layers." in name and name.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales", "g_idx"))
    assert held < 1.6 * stored and held < weights * 0.8  # float32 would be 4 bytes per weight
    # the packed values alone are exactly the file's 4 bits per weight
    assert sum(m.packed.numel() for m in layers) == weights // 2


def test_lora_on_a_quantized_base_equals_peft_merged_on_the_dequantized_base(source, tmp_path):
    quantized = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=True, desc_act=True,
                              dst_dequant=tmp_path / "twin")
    merged = strong_peft_adapter(tmp_path / "twin", ["q_proj", "v_proj", "down_proj"], tmp_path / "adapter", seed=5)
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS, model=merged)
    llm = LLM(str(quantized), dtype="float32", block_size=4)
    try:
        llm.add_lora("a", str(tmp_path / "adapter"))
        with_adapter = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora="a")]
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()
    assert with_adapter == expected and base != expected


TP_CASES = [("gptq-4bit-g32-asym-actorder", qc.write_gptq, dict(bits=4, group_size=32, sym=False, desc_act=True)),
            ("awq-g32", qc.write_awq, dict(group_size=32)),
            ("fp8-block", qc.write_fp8_block, dict(block=(32, 32)))]


@pytest.mark.parametrize("case", TP_CASES, ids=[c[0] for c in TP_CASES])
def test_tensor_parallel_2_equals_transformers(source, tmp_path, case):
    """Each rank cuts the quantized tensors itself: rows of q/k/v and gate/up, whole groups of o/down's input
    columns (an act-order layer's columns come from every group: each keeps its own)."""
    _, writer, options = case
    quantized = writer(source, tmp_path / "q", dst_dequant=tmp_path / "twin", **options)
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS)
    with LLM(str(quantized), dtype="float32", block_size=4, tensor_parallel_size=2, max_model_len=256,
             kv_cache_memory=4 << 20) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize("desc_act", [False, True], ids=["plain", "actorder"])
def test_a_partial_last_group_as_gptq_writes_it(model_dir_factory, tmp_path, desc_act):
    """Input widths that groups of 64 do not divide (96 = 64 + 32, 192 = 3 x 64: SmolLM2's 576 in groups of
    128 is the real case): the last group is partial, and greedy output still equals transformers'."""
    source = model_dir_factory("llama", hidden_size=96, intermediate_size=160, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=24)
    quantized = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=64, sym=False, desc_act=desc_act,
                              dst_dequant=tmp_path / "twin")
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS)
    with LLM(str(quantized), dtype="float32", block_size=4) as llm:
        o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
        assert o_proj.in_features == 96 and o_proj.stored_features == (96 if desc_act else 128)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_float_checkpoint_runs_as_fp8_with_quantization_fp8(source, tmp_path):
    """``quantization="fp8"`` on float weights: each projection row scaled to e4m3's range at load (as vLLM does);
    greedy output equals transformers on the weights rounded the same way."""
    from safetensors.torch import load_file, save_file

    import shutil

    from asyncllm.model.quant_methods import quantize_fp8_rows

    twin = tmp_path / "twin"
    shutil.copytree(source, twin)
    tensors = load_file(str(source / "model.safetensors"))
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            fp8, scale = quantize_fp8_rows(tensor, name)
            tensors[name] = (fp8.float() * scale).contiguous()
    save_file(tensors, str(twin / "model.safetensors"))
    expected = reference_greedy(twin, PROMPTS, NEW_TOKENS)
    with LLM(str(source), dtype="float32", block_size=4, quantization="fp8") as llm:
        assert {type(m) for m in _projections(llm)} == {Fp8Linear}
        assert all(m.weight.dtype == torch.float8_e4m3fn for m in _projections(llm))
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert expected != reference_greedy(source, PROMPTS, NEW_TOKENS)  # the rounding shows in the output


def test_dtype_bfloat16_holds_a_quantized_checkpoints_lm_head_as_bf16_panels(source, tmp_path):
    """dtype="bfloat16" on a 4-bit checkpoint: the projections stay 4-bit, the float LM head (and a tied table) is
    read as bf16 panels; small steps multiply in float32, so greedy output equals transformers on the dequantized
    weights with the head rounded to bf16, token for token."""
    from asyncllm.kernels.cpu_decode_stack import panels_supported
    from asyncllm.kernels.cpu_panel_linear import PanelLinear
    from checkpoints import load_reference_model

    quantized = qc.write_gptq(source, tmp_path / "q", dst_dequant=tmp_path / "twin", bits=4, group_size=32, sym=True)
    reference = load_reference_model(tmp_path / "twin")
    with torch.no_grad():
        reference.lm_head.weight.copy_(reference.lm_head.weight.to(torch.bfloat16))  # the tied table with it
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS, model=reference)
    # a float32 KV cache (the default under bfloat16 is bf16) and prompts under GROUP_QUANT_BF16_ROWS: exact
    with LLM(str(quantized), dtype="bfloat16", block_size=4, kv_cache_dtype="float32") as llm:
        runner = llm.engine.runner
        assert {type(m) for m in _projections(llm)} == {GroupQuantLinear}
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    if panels_supported():
        assert runner.bf16_head and not runner.bf16_weights
        assert all(m.bf16_rows == GROUP_QUANT_BF16_ROWS for m in _projections(llm)) or not _bf16_matmuls()
        head = runner.model.lm_head
        assert isinstance(head, PanelLinear) and head.panels.dtype == torch.bfloat16
        assert torch.equal(head.weight, reference.lm_head.weight)  # the head rounded to bf16, nothing else
        assert not torch.equal(head.weight, load_reference_model(tmp_path / "twin").lm_head.weight)
        assert got == expected
    else:  # no AVX-512 build: no panels, the float32 head as before
        assert not runner.bf16_weights


def test_dtype_bfloat16_prefills_a_4_bit_checkpoint_through_bf16_copies(source, tmp_path, monkeypatch):
    """A prompt of GROUP_QUANT_BF16_ROWS tokens or more under dtype="bfloat16": its 4-bit projections multiply a
    transient bf16 copy of the weight (oneDNN), the model stays 4-bit, and the answer stays within bf16's rounding
    of the float32 engine on the same checkpoint."""
    from asyncllm.kernels.cpu_decode_stack import panels_supported

    if not (panels_supported() and _bf16_matmuls()):
        pytest.skip("the bf16 path is an AVX-512 build's with oneDNN bf16 matmuls (checked off elsewhere)")
    quantized = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=True)
    prompt = random_prompts("long-bf16", [GROUP_QUANT_BF16_ROWS + 20])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    calls = []
    real = GroupQuantLinear._bf16_matmul
    monkeypatch.setattr(GroupQuantLinear, "_bf16_matmul", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    with LLM(str(quantized), dtype="bfloat16") as llm:
        assert {type(m) for m in _projections(llm)} == {GroupQuantLinear}
        assert all(m.packed.dtype == torch.uint8 for m in _projections(llm))  # still packed: no dense copy kept
        got = llm.generate(prompt, params)[0].outputs[0]
    assert calls and min(calls) >= GROUP_QUANT_BF16_ROWS
    with LLM(str(quantized), dtype="float32") as llm:
        exact = llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids[0] == exact.token_ids[0]
    first, first_exact = (next(iter(o.logprobs[0].values())) for o in (got, exact))
    assert first == pytest.approx(first_exact, abs=0.15) and first != first_exact

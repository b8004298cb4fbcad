"""Quantized mixture-of-experts checkpoints (model/moe_quantized.py): every expert's projections kept as the
checkpoint stores them (GPTQ, AWQ, compressed-tensors, FP8), greedy output equal to transformers on the same
dequantized weights, under tensor and expert parallelism, and with LoRA on the quantized experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.kernels.int8_linear import Int8Linear
from asyncllm.kernels.quant_linear import Fp8Linear, GroupQuantLinear
from asyncllm.toy import quantized as qc
from checkpoints import random_prompts, reference_greedy, strong_peft_adapter

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = random_prompts("quantized-moe", [1, 6, 19, 33])
MOE_LAYERS = (0, 2)  # the toy Qwen3-MoE's layer 1 is dense (mlp_only_layers)

# (id, writer, its options, the module each expert projection runs as)
FORMATS = [
    ("gptq-4bit-g32-asym-actorder", qc.write_gptq, dict(bits=4, group_size=32, sym=False, desc_act=True),
     GroupQuantLinear),
    ("gptq-8bit-g32-sym", qc.write_gptq, dict(bits=8, group_size=32, sym=True), Int8Linear),
    ("awq-g32", qc.write_awq, dict(group_size=32), GroupQuantLinear),
    ("ct-w4a16", qc.write_compressed_tensors, dict(scheme="W4A16", group_size=32), GroupQuantLinear),
    ("ct-w8a8", qc.write_compressed_tensors, dict(scheme="W8A8"), Int8Linear),
    ("ct-fp8-channel", qc.write_compressed_tensors, dict(scheme="FP8"), Fp8Linear),
    ("fp8-block-deepseek", qc.write_fp8_block, dict(block=(32, 32)), Fp8Linear),
]


@pytest.fixture(scope="module")
def source(model_dir_factory) -> Path:
    return model_dir_factory("qwen3_moe")


def _expert_modules(llm: LLM) -> list[torch.nn.Module]:
    layers = llm.engine.runner.model.model.layers
    stacks = [layers[i].mlp.experts for i in MOE_LAYERS]
    assert all(stack.w13 is None and stack.w2 is None for stack in stacks)  # no float copy of the experts
    return [m for stack in stacks for m in (*stack.quantized.gate_up, *stack.quantized.down)]


@pytest.mark.parametrize("case", FORMATS, ids=[f[0] for f in FORMATS])
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(source, tmp_path, case):
    _, writer, options, runs_as = case
    quantized = writer(source, tmp_path / "q", dst_dequant=tmp_path / "twin", **options)
    tensors = qc.read_tensors(quantized)
    weight = tensors.get("model.layers.0.mlp.experts.0.gate_proj.weight")  # the writer quantized the experts:
    assert len([n for n in tensors if ".experts.0.gate_proj." in n]) > 1 and (weight is None or weight.element_size() == 1)
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS)
    with LLM(str(quantized), dtype="float32", block_size=4) as llm:
        assert {type(m) for m in _expert_modules(llm)} == {runs_as}
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == expected


def test_quantized_experts_hold_the_checkpoints_bytes(source, tmp_path):
    """4-bit experts take what the file takes (half a byte per weight plus scales and zero points)."""
    quantized = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=False)
    with LLM(str(quantized), dtype="float32") as llm:
        modules = _expert_modules(llm)
        held = sum(t.numel() * t.element_size() for m in modules for t in m.buffers())
        weights = sum(m.in_features * m.out_features for m in modules)
        assert sum(m.packed.numel() for m in modules) == weights // 2  # exactly 4 bits per weight
    stored = sum(t.numel() * t.element_size() for name, t in qc.read_tensors(quantized).items()
                 if ".experts." in name and name.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales", "g_idx"))
    assert held < 1.6 * stored and held < weights * 0.8  # float32 would be 4 bytes per weight


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_quantized_experts_under_tp2_and_ep2_equal_transformers(source, tmp_path, expert_parallel):
    """TP: each rank cuts every expert's quantized tensors (gate/up rows, whole groups of the down input);
    EP: whole quantized experts per rank."""
    quantized = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=16, sym=False, desc_act=True,
                              dst_dequant=tmp_path / "twin")
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS)
    with LLM(str(quantized), dtype="float32", block_size=4, tensor_parallel_size=2, max_model_len=256,
             enable_expert_parallel=expert_parallel, kv_cache_memory=4 << 20) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_lora_on_quantized_experts_equals_peft_merged_on_the_dequantized_base(source, tmp_path):
    quantized = qc.write_awq(source, tmp_path / "q", group_size=32, dst_dequant=tmp_path / "twin")
    merged = strong_peft_adapter(tmp_path / "twin", ["q_proj"], tmp_path / "adapter", seed=4,
                                 parameters=["experts.gate_up_proj", "experts.down_proj"])
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS, model=merged)
    with LLM(str(quantized), dtype="float32", block_size=4) as llm:
        llm.add_lora("a", str(tmp_path / "adapter"))
        with_adapter = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora="a")]
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert with_adapter == expected and base != expected


def test_deepseek_v3_as_its_fp8_checkpoints_store_it(model_dir_factory, tmp_path):
    """DeepSeek V3's official layout: every projection FP8 in 128 x 128 blocks (here 32 x 32) with
    ``weight_scale_inv``, the latent attention's kv_b_proj too (widened at load: the absorbed form slices it),
    the experts kept FP8."""
    source = model_dir_factory("deepseek_v3")
    quantized = qc.write_fp8_block(source, tmp_path / "q", block=(32, 32), dst_dequant=tmp_path / "twin")
    tensors = qc.read_tensors(quantized)
    assert tensors["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    expected = reference_greedy(tmp_path / "twin", PROMPTS, NEW_TOKENS)
    with LLM(str(quantized), dtype="float32", block_size=4) as llm:
        layers = llm.engine.runner.model.model.layers
        stack = next(layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts"))
        assert {type(m) for m in (*stack.quantized.gate_up, *stack.quantized.down)} == {Fp8Linear}
        assert type(layers[0].self_attn.kv_a_proj_with_mqa) is Fp8Linear
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_quantized_latent_projection_other_than_fp8_is_refused_by_name(model_dir_factory, tmp_path):
    from asyncllm.errors import ModelLoadError

    quantized = qc.write_gptq(model_dir_factory("deepseek_v3"), tmp_path / "q", bits=4, group_size=32)
    with pytest.raises(ModelLoadError, match=r"kv_b_proj\.\w+': a gptq .* kv_b_proj is not supported \(FP8 is\)"):
        LLM(str(quantized), dtype="float32")

"""gpt-oss (model/gpt_oss.py): greedy output equal to transformers on a tiny checkpoint (whole and chunked prefill,
the CPU and torch attention backends, two tensor-parallel ranks), its MoE layer equal to transformers' GptOssMLP,
attention sinks in the CPU and Triton kernels equal to the torch reference (itself checked against transformers'
eager attention), and MXFP4 checkpoints dequantized at load exactly as transformers does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.kernels.torch_attention import windowed_attention
from asyncllm.model.gpt_oss import GptOssForCausalLM
from asyncllm.model.mxfp4 import FP4_VALUES, dequantize
from asyncllm.model.quant_formats import checkpoint_format
from checkpoints import random_prompts, reference_greedy
from kernel_cases import DEVICE, paged_batch

KIND = "gpt_oss"
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_references: dict[str, list[list[int]]] = {}


def prompts() -> list[list[int]]:
    return random_prompts(KIND, [1, 6, 17, 40])  # past the window of 8 and the 16-token chunks


def reference(model_dir) -> list[list[int]]:
    if KIND not in _references:
        _references[KIND] = reference_greedy(model_dir, prompts(), NEW_TOKENS)
    return _references[KIND]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]


# ---- whole models -----------------------------------------------------------------------------------------

def test_gpt_oss_greedy_equals_transformers(model_dir_factory):
    model_dir = model_dir_factory(KIND)
    expected = reference(model_dir)
    assert len(set(expected[-1])) > 5
    for engine_kwargs, backend in (({}, "cpu"), ({"block_size": 4, "max_num_batched_tokens": 16}, "cpu"),
                                   ({"block_size": 4, "attention_backend": "torch"}, "torch")):
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        runner = llm.engine.runner
        assert runner.architecture.native and runner.backend.name == backend
        layers = runner.model.model.layers
        assert [layer.self_attn.variant.get("window") for layer in layers] == [8, None]
        assert all(layer.self_attn.sinks is not None and type(layer.mlp).__name__ == "SparseMoE" for layer in layers)
        assert _tokens(llm) == expected, engine_kwargs
        assert llm.stats()["kv_blocks_used"] == 0
        llm.close()


def test_gpt_oss_tp2_equals_transformers(model_dir_factory):
    """Two CPU ranks: each holds its heads' sinks and a share of every expert's columns (down bias once)."""
    from safetensors import safe_open

    model_dir = model_dir_factory(KIND)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        sinks = f.get_tensor("model.layers.1.self_attn.sinks")
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, block_size=4, kv_cache_memory=4 << 20) as llm:
        layer = llm.engine.runner.model.model.layers[1]
        assert torch.equal(layer.self_attn.sinks.data, sinks[:2])  # rank 0: heads 0 and 1 of 4
        assert layer.mlp.experts.w2.shape == (4, 64, 16)
        got = _tokens(llm)
    assert got == reference(model_dir)


def test_moe_layer_equals_transformers_mlp():
    """The router (with its bias, top-k then softmax) and the experts loaded from the stacked, interleaved
    gate/up tensors with biases and the clamped SwiGLU, against transformers' GptOssMLP."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from asyncllm.model.moe import SparseMoE

    config = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          swiglu_limit=1.5)
    torch.manual_seed(0)
    theirs = GptOssMLP(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape))
    shape = GptOssForCausalLM.read_shape(config)
    ours = SparseMoE(shape, 0)
    ours.gate.weight.data.copy_(theirs.router.weight)
    ours.gate.bias.data.copy_(theirs.router.bias)
    filled = set()
    for name, tensor in theirs.experts.state_dict().items():
        filled |= ours.experts.load_checkpoint_tensor("experts", name, tensor, name)
    assert filled == ours.experts.expected_pieces("experts")
    x = torch.randn(11, 16)
    with torch.no_grad():
        expected, _ = theirs(x[None])
        assert (theirs.experts.gate_up_proj.abs() > 0).all() and expected.abs().max() > 1
        torch.testing.assert_close(ours(x), expected[0], rtol=1e-5, atol=1e-5)


# ---- attention sinks in the kernels -----------------------------------------------------------------------

MIXED = [(0, 1), (37, 1), (0, 23), (13, 9), (8, 5), (70, 1), (300, 1)]  # decodes, prefills, chunks, prefix hits


def _sinks(heads: int) -> torch.Tensor:
    return (torch.randn(heads, generator=torch.Generator().manual_seed(5)) * 2).to(DEVICE)


def _written(batch):
    meta = batch.meta()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    from asyncllm.kernels.torch_attention import write_kv_cache

    write_kv_cache(batch.key, batch.value, k_cache, v_cache, meta.slot_mapping)
    return meta, k_cache, v_cache


def test_reference_sinks_equal_transformers_eager_attention():
    """The torch reference's sinks are transformers' (a prefill of 23 tokens, grouped KV heads)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    batch = paged_batch([(0, 23)], 4, 2, 16, 4, torch.float32, seed=1)
    meta, k_cache, v_cache = _written(batch)
    sinks, scale = _sinks(4).cpu(), 16 ** -0.5
    got = windowed_attention(batch.query, k_cache, v_cache, meta, scale, None, None, sinks=sinks)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
    q, k, v = (t.transpose(0, 1)[None] for t in (batch.query, batch.key, batch.value))
    mask = torch.full((23, 23), float("-inf")).triu(1)[None, None]
    expected, _ = eager_attention_forward(module, q, k, v, mask, scale)
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_cpu_kernel_sinks_equal_the_reference(window):
    from asyncllm.kernels.cpu_attention import CpuAttentionBackend, cpu_kernels_available

    if not cpu_kernels_available():
        pytest.skip("no C compiler for the CPU kernels")
    batch = paged_batch(MIXED, 4, 2, 16, 4, torch.float32, seed=2)
    meta, k_cache, v_cache = _written(batch)
    sinks, scale = _sinks(4), 16 ** -0.5
    out = CpuAttentionBackend().forward(batch.query, k_cache, v_cache, meta, scale, window=window, sinks=sinks)
    ref = windowed_attention(batch.query, k_cache, v_cache, batch.meta(), scale, window, None, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = windowed_attention(batch.query, k_cache, v_cache, batch.meta(), scale, window, None)
    assert not torch.allclose(plain, out, atol=1e-3)  # the sinks changed the result


@pytest.mark.parametrize("window,dtype", [(None, torch.float32), (5, torch.float32), (None, torch.float16)],
                         ids=["full-f32", "window5-f32", "full-f16"])
@pytest.mark.parametrize("split", [True, False], ids=["splits", "one-split"])
def test_triton_kernel_sinks_equal_the_reference(window, dtype, split):
    """Sinks in the Triton kernel (TRITON_INTERPRET=1 without CUDA): one program's rows, and the split-KV merge."""
    from asyncllm.kernels.triton_attention import AttentionTuning, TritonAttentionBackend

    batch = paged_batch(MIXED, 4, 2, 16, 4, dtype, seed=3)
    tuning = (AttentionTuning(tile_n=16, prefill_block_m=16, min_split_tokens=8, num_sms=4) if split
              else AttentionTuning(tile_n=16, prefill_block_m=16, min_split_tokens=16, num_sms=1))
    backend = TritonAttentionBackend(4, 2, tuning)
    meta, k_cache, v_cache = _written(batch)
    backend.prepare(meta)
    assert (meta.backend_state.launches[0].num_splits > 1) == split
    sinks, scale = _sinks(4).to(dtype), 16 ** -0.5
    out = backend.forward(batch.query, k_cache, v_cache, meta, scale, window=window, sinks=sinks)
    ref = windowed_attention(batch.query.float(), k_cache.float(), v_cache.float(), batch.meta(), scale, window,
                             None, sinks=sinks.float())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), ref, rtol=tolerance, atol=tolerance)
    plain = windowed_attention(batch.query.float(), k_cache.float(), v_cache.float(), batch.meta(), scale, window,
                               None)
    assert not torch.allclose(plain, out.float(), atol=1e-2)


# ---- MXFP4 checkpoints (as OpenAI publishes gpt-oss) -------------------------------------------------------

_FP4 = torch.tensor(FP4_VALUES)


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> MXFP4 blocks [E, N, K / 32, 16] and scales [E, N, K / 32]: per 32 values the smallest power
    of two that brings them within FP4's +-6, each value then the nearest FP4 code (low nibble first)."""
    e, n, k = weight.shape
    groups = weight.reshape(e, n, k // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - _FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def _mxfp4_copy(model_dir, out):
    """The float checkpoint with its stacked experts stored as transformers' MXFP4 checkpoints store them."""
    from safetensors.torch import load_file, save_file

    out = shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())  # [E, K, N] -> rows N
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_dequantize_decodes_every_code_and_scale():
    """Each byte holds two E2M1 codes, the low nibble first; a group's E8M0 scale is a power of two, bias 127."""
    low, high = torch.arange(16, dtype=torch.uint8), torch.arange(15, -1, -1, dtype=torch.uint8)
    blocks = (low | (high << 4)).view(1, 1, 16)  # one row of 32 values, one group
    values = _FP4[torch.stack((low, high), dim=-1).flatten().long()]
    assert torch.equal(dequantize(blocks, torch.tensor([[127 + 3]], dtype=torch.uint8))[0], values * 8)
    assert torch.equal(dequantize(blocks, torch.tensor([[127 - 2]], dtype=torch.uint8))[0], values / 4)


def test_mxfp4_checkpoint_equals_transformers_dequantized(model_dir_factory, tmp_path):
    """The experts dequantized at load are exactly transformers' (Mxfp4Config(dequantize=True)), and so is the
    greedy output; TP=1, the CPU backend."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model_dir = _mxfp4_copy(model_dir_factory(KIND), tmp_path / "mxfp4")
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    expected = reference_greedy(model_dir, prompts()[1:3], NEW_TOKENS, model=theirs)
    with LLM(str(model_dir), dtype="float32", block_size=4) as llm:
        assert llm.engine.runner.weight_format.checkpoint is None  # a float model once loaded
        stack = llm.engine.runner.model.model.layers[1].mlp.experts
        their_stack = theirs.model.layers[1].mlp.experts
        assert torch.equal(stack.w13.data, torch.cat([their_stack.gate_up_proj[:, :, 0::2],
                                                      their_stack.gate_up_proj[:, :, 1::2]], 2).transpose(1, 2))
        assert torch.equal(stack.w2.data, their_stack.down_proj.transpose(1, 2))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts()[1:3], GREEDY)]
    assert got == expected


def test_mxfp4_is_refused_by_name_where_the_family_does_not_dequantize_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ModelLoadError, match="quantization method 'mxfp4'"):
        checkpoint_format(tmp_path)
    assert checkpoint_format(tmp_path, GptOssForCausalLM.dequantized_formats) is None

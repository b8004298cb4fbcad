"""gpt-oss (model/gpt_oss.py): greedy output equal to transformers on a tiny checkpoint (whole and chunked prefill,
the CPU and torch attention backends, two tensor-parallel ranks), its MoE layer equal to transformers' GptOssMLP,
attention sinks in the CPU and Triton kernels equal to the torch reference (itself checked against transformers'
eager attention), and MXFP4 checkpoints refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.kernels.torch_attention import windowed_attention
from asyncllm.model.gpt_oss import GptOssForCausalLM
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


# ---- refused checkpoints ----------------------------------------------------------------------------------

def test_mxfp4_checkpoint_is_refused_by_name(model_dir_factory, tmp_path):
    """What OpenAI publishes: experts in MXFP4 (``*_blocks``/``*_scales`` tensors) behind quant_method mxfp4."""
    model_dir = shutil.copytree(model_dir_factory(KIND), tmp_path / "mxfp4")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"MXFP4 \(config key quantization_config.quant_method 'mxfp4'\)"):
        LLM(str(model_dir), dtype="float32")

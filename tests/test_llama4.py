"""Llama 4 (model/llama4.py): greedy output equal to transformers on a tiny checkpoint whose every feature decides
tokens (chunked attention in chunks of 8 on the rope layers, weightless q/k norms, a NoPE layer with temperature
tuning, dense and top-1 sigmoid-routed MoE layers with the weight on the expert's input and a shared expert), through
whole and chunked prefill on the CPU and torch backends, under tensor parallelism, with a LoRA adapter on attention
and from a multimodal checkpoint loaded text-only; the backends' chunked attention against a plain masked softmax; configs refused by key."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.kernels.cpu_attention import CpuAttentionBackend, cpu_kernels_available
from asyncllm.kernels.torch_attention import TorchAttentionBackend
from asyncllm.model.llama4 import Llama4ForCausalLM, NormedRope, TemperatureTuning
from checkpoints import load_reference_model, random_prompts, reference_greedy, strong_peft_adapter
from kernel_cases import DEVICE, paged_batch

NEW_TOKENS = 16
CHUNK = 8  # the toy checkpoint's attention_chunk_size
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_references: dict[str, list[list[int]]] = {}


def prompts() -> list[list[int]]:
    return random_prompts("llama4", [1, 6, 17, 40])  # the longer ones span several chunks


def reference(model_dir) -> list[list[int]]:
    if "llama4" not in _references:
        _references["llama4"] = reference_greedy(model_dir, prompts(), NEW_TOKENS)
    return _references["llama4"]


def _tokens(llm: LLM, prompt_list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_list, GREEDY)]


# ---- whole models -----------------------------------------------------------------------------------------

def test_llama4_greedy_equals_transformers(model_dir_factory):
    model_dir = model_dir_factory("llama4")
    expected = reference(model_dir)
    assert len(set(expected[-1])) > 5
    for engine_kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 16},  # whole and chunked prefill
                          {"block_size": 4, "attention_backend": "torch"}):
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        runner = llm.engine.runner
        assert runner.architecture.native and runner.decode_stack is None and runner.cuda_graphs is None
        layers = runner.model.model.layers
        assert [type(layer.mlp).__name__ for layer in layers] == ["MLP", "SparseMoE", "MLP", "SparseMoE"]
        assert [type(layer.self_attn.rotary).__name__ for layer in layers] == ["NormedRope"] * 3 + [
            "TemperatureTuning"]
        assert [layer.self_attn.variant for layer in layers] == [{"chunk": CHUNK}] * 3 + [{}]
        assert layers[0].mlp.gate_up_proj.weight.shape == (2 * 96, 64)  # intermediate_size_mlp
        assert layers[1].mlp.experts.w13.shape == (4, 2 * 32, 64)
        assert _tokens(llm, prompts()) == expected, engine_kwargs
        assert llm.stats()["kv_blocks_used"] == 0
        llm.close()


def test_tensor_parallel_equals_transformers(model_dir_factory):
    """Two gloo ranks: 2 of the 4 query heads and 1 of the 2 KV heads each, half of every expert's columns, half of
    the dense and shared MLPs; the tokens are transformers'."""
    model_dir = model_dir_factory("llama4")
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, block_size=4, kv_cache_memory=4 << 20) as llm:
        layers = llm.engine.runner.model.model.layers
        assert layers[1].mlp.experts.w13.shape == (4, 32, 64)
        assert layers[0].mlp.gate_up_proj.weight.shape == (96, 64)
        assert layers[1].mlp.shared_expert.gate_up_proj.weight.shape == (32, 64)
        assert _tokens(llm, prompts()) == reference(model_dir)


def test_multimodal_checkpoint_loads_text_only(model_dir_factory, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (vision tower, projector, text model under language_model.)
    gives the tokens of the text model it holds; the vision tensors are skipped."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    model_dir = model_dir_factory("llama4")
    text = load_reference_model(model_dir)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = Llama4Config(text_config=text.config.to_dict(), vision_config=vision)
    config.text_config.architectures = None  # as published checkpoints have it
    model = Llama4ForConditionalGeneration(config)
    model.language_model.load_state_dict(text.state_dict())
    out = tmp_path / "llama4-mm"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    with LLM(str(out), dtype="float32", block_size=4) as llm:
        runner = llm.engine.runner
        assert type(runner.model).__name__ == "Llama4ForConditionalGeneration"
        assert _tokens(llm, prompts()[1:3]) == reference(model_dir)[1:3]


def test_lora_on_attention_equals_peft_merged(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("llama4")
    merged = strong_peft_adapter(model_dir, ["q_proj", "v_proj", "o_proj"], tmp_path / "adapter", seed=3)
    expected = reference_greedy(model_dir, prompts()[1:], NEW_TOKENS, model=merged)
    assert expected != reference(model_dir)[1:]
    with LLM(str(model_dir), dtype="float32", block_size=4) as llm:
        llm.add_lora("a", str(tmp_path / "adapter"))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts()[1:], GREEDY, lora="a")] == expected


def test_configs_refused_by_key(model_dir_factory):
    config = load_reference_model(model_dir_factory("llama4")).config
    for key, value, message in (("layer_types", ["sliding_attention"] * 4, "layer_types"),
                                ("no_rope_layers", [1, 1], "no_rope_layers"),
                                ("moe_layers", [1, 7], "moe_layers"),
                                ("hidden_act", "gelu", "hidden_act")):
        bad = copy.deepcopy(config)
        setattr(bad, key, value)
        with pytest.raises(ModelLoadError, match=message):
            Llama4ForCausalLM.check_config(bad)


def test_position_treatments_equal_transformers():
    """The rope layers' rope + weightless q/k norm and the NoPE layers' temperature tuning, against transformers'
    own functions, at positions past several chunks and floor_scale steps."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextL2Norm, Llama4TextRotaryEmbedding, \
        apply_rotary_emb

    config = Llama4TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, floor_scale=4, attn_scale=0.5,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(0, 60, 3)
    q, k = torch.randn(20, 4, 16, generator=gen), torch.randn(20, 2, 16, generator=gen)
    rotaries = Llama4ForCausalLM.make_rotaries(config, Llama4ForCausalLM.read_shape(config), 64)
    rope, nope = rotaries[0], rotaries[3]
    assert isinstance(rope, NormedRope) and isinstance(nope, TemperatureTuning)
    rope.build(torch.device("cpu"), torch.float32)
    freqs = Llama4TextRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_emb(q[None], k[None], freqs)
    norm = Llama4TextL2Norm(config.rms_norm_eps)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, norm(want_q)[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, norm(want_k)[0], atol=1e-6, rtol=1e-6)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / 4)) * 0.5 + 1.0
    got_q, got_k = nope(positions, q, k)
    assert torch.equal(got_q, q * scales[:, None, None]) and torch.equal(got_k, k)


# ---- chunked attention in the backends ----------------------------------------------------------------------

# (cached, new) per sequence: decodes at every offset in a chunk, a fresh prefill over several chunks, later chunks of
# prompts starting mid-chunk, one ending on a chunk boundary
CHUNKED = [(0, 1), (7, 1), (8, 1), (12, 1), (37, 1), (0, 23), (13, 9), (8, 5), (5, 11), (70, 1)]


def masked_softmax(batch, k_cache, v_cache, scale: float, chunk: int) -> torch.Tensor:
    """Plain attention per sequence: every key gathered from its block, scores masked to the query's chunk."""
    query, k_cache, v_cache = batch.query.cpu(), k_cache.cpu(), v_cache.cpu()
    out = torch.empty(query.shape, dtype=torch.float32)
    heads, kv_heads = query.shape[1], k_cache.shape[2]
    row = 0
    for (cached, new), table in zip(batch.specs, batch.block_tables):
        length = cached + new
        slots = [table[p // batch.block_size] * batch.block_size + p % batch.block_size for p in range(length)]
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [keys, heads, dim]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        for j in range(new):
            p = cached + j
            scores = torch.einsum("hd,khd->hk", query[row].float(), k) * scale
            keys = torch.arange(length)
            scores[:, (keys > p) | (keys < p // chunk * chunk)] = float("-inf")
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
            row += 1
    return out


def _written(batch, backend, meta):
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend.write_kv(batch.key, batch.value, k_cache, v_cache, meta)
    return k_cache, v_cache


@pytest.mark.parametrize("chunk", [8, 5], ids=["chunk8-aligned", "chunk5-unaligned"])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_chunked_attention_equals_a_masked_softmax(backend_name, chunk):
    if backend_name == "cpu" and (DEVICE.type != "cpu" or not cpu_kernels_available()):
        pytest.skip("the CPU decode kernel runs on CPU tensors, where it is built")
    batch = paged_batch(CHUNKED, 4, 2, 16, 4, torch.float32, seed=5)
    backend = TorchAttentionBackend() if backend_name == "torch" else CpuAttentionBackend()
    meta = batch.meta()
    backend.prepare(meta)
    k_cache, v_cache = _written(batch, backend, meta)
    out = backend.forward(batch.query, k_cache, v_cache, meta, 0.25, chunk=chunk)
    torch.testing.assert_close(out.cpu(), masked_softmax(batch, k_cache, v_cache, 0.25, chunk), atol=2e-5, rtol=2e-5)
    plain = backend.forward(batch.query, k_cache, v_cache, meta, 0.25)
    assert not torch.allclose(plain, out, atol=1e-3)  # the chunks changed the result


def test_triton_chunked_attention_equals_a_masked_softmax():
    """The kernel's chunk specialisation (in triton's interpreter on CPU), decodes split over the KV dimension, chunks
    of 5 that start inside blocks of 4 and inside the kernel's tiles of 16."""
    chunk = 5
    pytest.importorskip("triton")
    from asyncllm.kernels.triton_attention import AttentionTuning, TritonAttentionBackend

    batch = paged_batch(CHUNKED, 4, 2, 16, 4, torch.float32, seed=5)
    backend = TritonAttentionBackend(4, 2, AttentionTuning(tile_n=16, prefill_block_m=16, min_split_tokens=8,
                                                           num_sms=16))
    meta = batch.meta()
    backend.prepare(meta)
    assert meta.backend_state.launches[0].num_splits > 1
    k_cache, v_cache = _written(batch, backend, meta)
    out = backend.forward(batch.query, k_cache, v_cache, meta, 0.25, chunk=chunk)
    torch.testing.assert_close(out.cpu(), masked_softmax(batch, k_cache, v_cache, 0.25, chunk), atol=2e-5, rtol=2e-5)

"""The native model families beyond Llama: greedy output equal to transformers token for token.

Each kind is a tiny random-weight checkpoint built with transformers' own classes
(asyncllm/toy/checkpoints.py, FAMILIES). Prompts run past the checkpoints' small sliding windows
(8 tokens), longrope's original context (32) and dynamic rope's limit (32), so those code paths
decide tokens here.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.model.registry import architecture_for
from checkpoints import (assert_greedy_equal_up_to_ties, fresh_reference_greedy, load_reference_model, random_prompts,
                         reference_greedy, strong_peft_adapter)

FAMILY_KINDS = ["llama_bias", "llama_longrope", "mistral_window", "qwen2_window", "phi4_mini", "gemma", "gemma2", "gemma3",
                "granite", "olmo2", "smollm3", "cohere", "glm4", "llama_dynamic"]
PROMPT_LENGTHS = [1, 5, 9, 17, 40]
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_references: dict[str, list[list[int]]] = {}


def prompts(kind: str) -> list[list[int]]:
    return random_prompts(kind, PROMPT_LENGTHS)


def reference(kind: str, model_dir) -> list[list[int]]:
    """transformers' greedy continuations (a fresh model per prompt, for dynamic rope's sake)."""
    if kind not in _references:
        _references[kind] = fresh_reference_greedy(model_dir, prompts(kind), NEW_TOKENS)
    return _references[kind]


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_greedy_equals_transformers(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)
    expected = reference(kind, model_dir)
    assert len(set(expected[-1])) > 5  # the checkpoint says varied things: a real check, not a repeated token
    for engine_kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 16}):  # whole and chunked prefill
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        assert llm.engine.runner.architecture.native
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)]
        assert got == expected, engine_kwargs
        assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kind", ["gemma2", "glm4"])
def test_family_streams_equal_transformers(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)

    async def run():
        async with AsyncLLM(str(model_dir), dtype="float32") as llm:
            async def one(prompt):
                tokens = []
                async for out in llm.stream_outputs(prompt, GREEDY):
                    tokens.extend(out.outputs[0].token_ids)  # each output is the step's delta
                return tokens
            return await asyncio.gather(*(one(p) for p in prompts(kind)))

    assert asyncio.run(run()) == reference(kind, model_dir)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_runs_windows_and_soft_caps(backend, model_dir_factory):
    """Gemma 2 (alternating 8-token windows, capped scores) on the torch reference and on the Triton
    kernel (its interpreter on CPU; the default CPU backend is test_family_greedy_equals_transformers)."""
    from kernel_cases import DEVICE

    model_dir = model_dir_factory("gemma2")
    llm = LLM(str(model_dir), dtype="float32", attention_backend=backend, device=str(DEVICE), block_size=4)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts("gemma2"), GREEDY)] == reference("gemma2", model_dir)


def test_prefix_cache_hit_inside_a_window_stays_exact(model_dir_factory):
    """A second request sharing a 40-token prefix reuses its cached blocks (windowed layers read only
    the blocks inside their window) and still equals transformers."""
    model_dir = model_dir_factory("mistral_window")
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    first = prompts("mistral_window")[-1]
    llm.generate([first], GREEDY)
    second = first + [7, 8, 9]
    (out,) = llm.generate([second], GREEDY)
    assert out.metrics.num_cached_tokens >= 36
    expected = reference_greedy(model_dir, [second], NEW_TOKENS, model=load_reference_model(model_dir))[0]
    assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "glm4", "granite", "llama_bias"])
def test_fast_paths_off_where_the_family_differs_from_llama(kind, model_dir_factory):
    """The C decode stack computes Llama's layers only: these families run the module path."""
    llm = LLM(str(model_dir_factory(kind)), dtype="float32")
    assert llm.engine.runner.decode_stack is None


def test_families_are_declared_by_their_classes(model_dir_factory):
    from transformers import AutoConfig

    glm = architecture_for(AutoConfig.from_pretrained(model_dir_factory("glm4")))
    cls = glm.model_class()
    assert set(glm.fused) == {"q_proj", "k_proj", "v_proj"}  # gate_up_proj is fused in its checkpoints
    assert cls.renamed["post_mlp_layernorm"] == "post_feedforward_layernorm"
    olmo = architecture_for(AutoConfig.from_pretrained(model_dir_factory("olmo2"))).model_class()
    assert not olmo.fast_paths.tensor_parallel


@pytest.mark.parametrize("kind", ["phi4_mini", "llama_dynamic"])
def test_length_dependent_rope_keeps_prefix_cache_hits_exact(kind, model_dir_factory):
    """A long prompt after a short one with the same first tokens: the short prompt's KV was rotated
    for a short sequence, so the long one must not reuse it (their cache keys differ), and both stay
    equal to transformers."""
    model_dir = model_dir_factory(kind)
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    long_prompt = prompts(kind)[-1]          # 40 tokens: past the 32-token limit of both checkpoints
    short_prompt = long_prompt[:20]
    runner = llm.engine.runner
    assert runner.rope_cache_key(len(short_prompt)) != runner.rope_cache_key(len(long_prompt))
    (short_out,) = llm.generate([short_prompt], GREEDY)
    (long_out,) = llm.generate([long_prompt], GREEDY)
    assert long_out.metrics.num_cached_tokens == 0
    fresh = fresh_reference_greedy(model_dir, [short_prompt, long_prompt], NEW_TOKENS)
    assert [short_out.outputs[0].token_ids, long_out.outputs[0].token_ids] == fresh


@pytest.mark.parametrize("kind", ["llama_bias", "gemma2", "gemma3", "glm4", "granite", "cohere", "smollm3",
                                  "phi4_mini"])
def test_family_tp2_greedy_equals_transformers(kind, model_dir_factory):
    """Two CPU ranks (gloo), every family that splits: row-parallel biases kept once (Llama with biases),
    windows and soft caps on each rank's heads (Gemma 2/3), a checkpoint-fused gate/up and half-width
    interleaved rope (GLM-4), multipliers (Granite), the parallel block and its tied, scaled head
    (Cohere), layers without rope (SmolLM3), fused q/k/v with partial rotary and longrope (Phi-4-mini)."""
    model_dir = model_dir_factory(kind)
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, block_size=4,
             kv_cache_memory=4 << 20) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)]
    assert got == reference(kind, model_dir)


def test_a_family_that_cannot_split_says_so(model_dir_factory):
    from asyncllm.errors import ConfigError

    with pytest.raises(ConfigError, match="Olmo2ForCausalLM runs on one device only"):
        LLM(str(model_dir_factory("olmo2")), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize("kind,targets", [("gemma2", ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
                                          ("glm4", ["q_proj", "k_proj", "o_proj", "down_proj"])])
def test_family_lora_equals_peft_merged(kind, targets, model_dir_factory, tmp_path):
    """PEFT adapters on the families' own module names ride the engine's fused projections."""
    model_dir = model_dir_factory(kind)
    merged = strong_peft_adapter(model_dir, targets, tmp_path / "adapter", seed=7)
    expected = reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=merged)
    assert expected != reference(kind, model_dir)
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    llm.add_lora("a", str(tmp_path / "adapter"))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY, lora="a")] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)] == reference(kind, model_dir)


_GGUF_CONFIG_KEYS = {"granite": ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"),
                     "cohere": ("logit_scale", "layer_norm_eps"), "gemma2": ("attn_logit_softcapping",
                                                                            "final_logit_softcapping")}


@pytest.mark.parametrize("kind", ["llama_bias", "phi3", "phi4_mini", "gemma", "gemma2", "gemma3_6", "granite", "olmo2", "smollm3",
                                  "cohere", "glm4"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_family_gguf_equals_its_original(kind, qtype, model_dir_factory, tmp_path):
    """A GGUF file written as llama.cpp's converter writes the family (Phi-3's fused attn_qkv/ffn_up,
    Phi-4-mini's partial rotary and longrope factor tensors, Gemma 2's four norms stored as 1 + w, its
    soft caps and window as metadata) equals transformers on
    the original checkpoint; for Q8_0, on the original with every projection rounded through Q8_0 by
    gguf's own quantizer. (transformers' GGUF loader is no oracle here: it drops Gemma 2's untied head.)"""
    import gguf as gguf_package
    import torch
    from asyncllm.toy.gguf_export import export_gguf

    model_dir = model_dir_factory(kind)
    file = export_gguf(model_dir, tmp_path / f"{kind}-{qtype}.gguf", qtype)
    llm = LLM(str(file), dtype="float32")
    assert llm.engine.runner.architecture.native and llm.engine.runner.weight_format.int8 == (qtype == "Q8_0")
    original = load_reference_model(model_dir).config
    for key in _GGUF_CONFIG_KEYS.get(kind, ()):  # values that change no greedy token (logit scales) checked here
        assert getattr(llm.engine.hf_config, key) == pytest.approx(getattr(original, key)), key
    if kind == "phi4_mini":  # read back from the file's tensors and metadata, not from transformers' reader
        rope = llm.engine.hf_config.rope_parameters
        assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
        assert llm.engine.runner.length_dependent_rope
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)]
    model = load_reference_model(model_dir)
    if qtype == "Q8_0":
        kind_q8 = gguf_package.GGMLQuantizationType.Q8_0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2:  # projections, the head and the embedding (the exporter quantizes it too)
                    packed = gguf_package.quants.quantize(param.numpy(), kind_q8)
                    param.copy_(torch.from_numpy(gguf_package.quants.dequantize(packed, kind_q8)).reshape(param.shape))
    expected = reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=model)
    # Q8_0 GLM-4's first prompt meets a top-two margin of 1e-5 at token 13 (a float32 summation-order tie)
    assert_greedy_equal_up_to_ties(got, expected, prompts(kind), model)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_blocks_behind_every_window_are_given_back(backend, model_dir_factory):
    """Mistral with an 8-token window in every layer: once its prompt is in, a sequence holds only the
    blocks its window can reach (here at most 4 of 4 tokens, where 60 new tokens after a 40-token
    prompt would otherwise hold 25), and the tokens still equal transformers' (no kernel reads a
    released block)."""
    from kernel_cases import DEVICE

    model_dir = model_dir_factory("mistral_window")
    llm = LLM(str(model_dir), dtype="float32", block_size=4, attention_backend=backend, device=str(DEVICE))
    assert llm.engine.kv.window == 8
    batch = [prompts("mistral_window")[-1], prompts("mistral_window")[2]]  # 40 and 9 tokens
    used: list[int] = []
    original_step = llm.engine.step

    def watching_step():
        result = original_step()
        used.append(llm.engine.kv.num_used_blocks)
        return result

    llm.engine.step = watching_step
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == fresh_reference_greedy(model_dir, batch, 60)
    assert max(used[1:-1]) <= 2 * (8 // 4 + 2)  # after the prefill step: each sequence its window's blocks
    assert llm.stats()["kv_blocks_used"] == 0


def test_released_blocks_and_forks_agree(model_dir_factory):
    """n=3 children fork a windowed sequence's table after its prompt's blocks were released: each
    child shares only the live blocks, and every child equals transformers."""
    model_dir = model_dir_factory("mistral_window")
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    prompt = prompts("mistral_window")[-1]
    (out,) = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True))
    expected = fresh_reference_greedy(model_dir, [prompt], 30)[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert llm.stats()["kv_blocks_used"] == 0

"""Architectures without a native file: transformers' own modules with the engine's paged attention.

Each kind (asyncllm/toy/checkpoints.py, TRANSFORMERS_BACKEND_KINDS) is a tiny random-weight
checkpoint built with transformers' classes; greedy output must equal transformers' token for token
through LLM (whole and chunked prefill, prefix-cache hits), AsyncLLM streams and the server.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.errors import ConfigError, LoRAError, ModelLoadError
from asyncllm.server import create_app
from asyncllm.toy.checkpoints import TRANSFORMERS_BACKEND_KINDS
from checkpoints import load_reference_model, random_prompts, reference_greedy, strong_peft_adapter
from server_helpers import request

PROMPT_LENGTHS = [1, 6, 13, 30]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_references: dict[str, list[list[int]]] = {}


def prompts(kind: str) -> list[list[int]]:
    return random_prompts(kind, PROMPT_LENGTHS)


def reference(kind: str, model_dir) -> list[list[int]]:
    if kind not in _references:
        _references[kind] = reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=load_reference_model(model_dir))
    return _references[kind]


@pytest.mark.parametrize("kind", TRANSFORMERS_BACKEND_KINDS)
def test_fallback_greedy_equals_transformers(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)
    expected = reference(kind, model_dir)
    for engine_kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 16}):
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        runner = llm.engine.runner
        assert not runner.architecture.native and runner.decode_stack is None
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)] == expected, engine_kwargs
        # a prompt that extends one already served: its blocks come from the prefix cache
        longer = prompts(kind)[-1] + [9, 10, 11]
        (out,) = llm.generate([longer], GREEDY)
        assert out.metrics.num_cached_tokens >= 16
        assert out.outputs[0].token_ids == reference_greedy(model_dir, [longer], NEW_TOKENS,
                                                            model=load_reference_model(model_dir))[0]
        assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kind", TRANSFORMERS_BACKEND_KINDS)
def test_fallback_streams_and_server_equal_transformers(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)
    expected = reference(kind, model_dir)

    async def streams(llm):
        async def one(prompt):
            tokens = []
            async for out in llm.stream_outputs(prompt, GREEDY):
                tokens.extend(out.outputs[0].token_ids)
            return tokens
        return list(await asyncio.gather(*(one(p) for p in prompts(kind))))

    llm = AsyncLLM(str(model_dir), dtype="float32")
    try:
        assert asyncio.run(streams(llm)) == expected
        app = create_app(llm)
        body = {"model": app.state.asyncllm.model_name, "prompt": prompts(kind)[2], "max_tokens": NEW_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0}
        response = request(app, "POST", "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert [int(t.removeprefix("token_id:")) for t in tokens] == expected[2]
    finally:
        llm.close()


def test_model_impl_forces_either_path(model_dirs, model_dir_factory):
    """A native family through transformers' modules gives the same tokens; an architecture
    without a native file cannot be forced native."""
    llama = model_dirs["llama"]
    prompts_ = [[5, 6, 7, 8, 9], [300, 2]]
    native = LLM(str(llama), dtype="float32").generate(prompts_, GREEDY)
    through = LLM(str(llama), dtype="float32", model_impl="transformers")
    assert not through.engine.runner.architecture.native
    assert [o.outputs[0].token_ids for o in through.generate(prompts_, GREEDY)] == \
           [o.outputs[0].token_ids for o in native]
    with pytest.raises(ModelLoadError, match="model_impl='native'"):
        LLM(str(model_dir_factory("gpt2")), dtype="float32", model_impl="native")
    with pytest.raises(ConfigError, match="model_impl"):
        LLM(str(llama), model_impl="fastest")


def test_what_the_fallback_does_not_take_is_refused_clearly(model_dir_factory, tmp_path):
    """int8, TP, and LoRA where the architecture has no PEFT-named projections (GPT-2's fused c_attn)."""
    gpt2 = str(model_dir_factory("gpt2"))
    with pytest.raises(ConfigError, match="quantization='int8'"):
        LLM(gpt2, dtype="float32", quantization="int8")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        LLM(gpt2, dtype="float32", tensor_parallel_size=2)
    llm = LLM(gpt2, dtype="float32")
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]}))
    with pytest.raises(LoRAError, match="not supported for this architecture"):
        llm.add_lora("x", str(adapter))


def test_an_architecture_without_custom_attention_is_refused(tmp_path):
    from transformers import FalconConfig

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    config.architectures = ["FalconForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="_supports_attention_backend"):
        LLM(str(tmp_path))


def test_load_fails_when_the_paged_path_does_not_reproduce_transformers(model_dir_factory, monkeypatch):
    """The load-time check is the safety net for math the paged path cannot see: here the LM head's
    post-processing is made wrong, and the load must fail instead of serving wrong tokens."""
    from asyncllm.model import transformers_backend

    original = transformers_backend.TransformersModel.compute_logits
    monkeypatch.setattr(transformers_backend.TransformersModel, "compute_logits",
                        lambda self, hidden: original(self, hidden) * 1.5)
    with pytest.raises(ModelLoadError, match="do not reproduce"):
        LLM(str(model_dir_factory("gpt2")), dtype="float32")


@pytest.mark.parametrize("kind,targets", [("ernie4_5", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]),
                                          ("starcoder2", ["q_proj", "v_proj", "o_proj"])])
def test_fallback_lora_equals_peft_merged(kind, targets, model_dir_factory, tmp_path):
    """PEFT adapters on an architecture without a native file: applied by hooks on transformers' own
    projections, mixed with base-model requests in one batch, equal to PEFT's merged model."""
    model_dir = model_dir_factory(kind)
    merged = strong_peft_adapter(model_dir, targets, tmp_path / "adapter", seed=11)
    expected = reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=merged)
    assert expected != reference(kind, model_dir)
    llm = LLM(str(model_dir), dtype="float32")
    assert set(targets) <= set(llm.engine.runner.lora.layout.targets)
    llm.add_lora("a", str(tmp_path / "adapter"))
    count = len(prompts(kind))
    mixed = llm.generate(prompts(kind) * 2, GREEDY, lora=["a"] * count + [None] * count)  # one batch, both kinds
    assert [o.outputs[0].token_ids for o in mixed] == expected + reference(kind, model_dir)


def test_fallback_structured_output_follows_the_schema(model_dir_factory):
    """Structured output is the engine's (a grammar mask on the logits), so it holds on transformers'
    modules too: every sampled answer parses and validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    llm = LLM(str(model_dir_factory("starcoder2")), dtype="float32")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120, json_schema=schema) for seed in range(4)]
    for out in llm.generate(["Describe a person:"] * 4, params):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)

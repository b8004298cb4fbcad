"""Greedy token-for-token parity with transformers on the tests' random-weight checkpoints."""

import random

import pytest

from asyncllm import LLM, SamplingParams
from checkpoints import load_reference_model, reference_greedy

KINDS = ["llama", "qwen2", "qwen3", "mistral"]
PROMPT_LENGTHS = [1, 3, 6, 9, 14, 17, 25, 33]  # 8 prompts, crossing block boundaries of 4 and 16
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_references: dict[str, list[list[int]]] = {}


def parity_prompts(kind: str) -> list[list[int]]:
    rng = random.Random(kind)
    return [[rng.randrange(5, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference(kind: str, model_dir) -> list[list[int]]:
    if kind not in _references:
        model = load_reference_model(model_dir)
        _references[kind] = reference_greedy(model_dir, parity_prompts(kind), NEW_TOKENS, model=model)
    return _references[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine_kwargs", [{}, {"block_size": 4, "max_num_batched_tokens": 32}],
                         ids=["default", "chunked-prefill"])
def test_batched_greedy_equals_transformers(kind, engine_kwargs, model_dirs):
    llm = LLM(str(model_dirs[kind]), dtype="float32", **engine_kwargs)
    outputs = llm.generate(parity_prompts(kind), GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == reference(kind, model_dirs[kind])
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0


def test_text_prompt_equals_its_token_ids(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.tokenizer.encode(text)
    by_text, by_ids = llm.generate([text, ids], GREEDY)
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_n_greedy_children_share_blocks_and_equal_transformers(model_dirs):
    """n=4 greedy: the children fork onto the prompt's blocks (copy-on-write of the partial
    last block) and must each reproduce transformers' greedy continuation exactly."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    prompt = parity_prompts("llama")[5]  # 17 tokens: the last block is partial
    (out,) = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    expected = reference("llama", model_dirs["llama"])[5]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == expected for c in out.outputs)
    assert llm.stats()["kv_blocks_used"] == 0

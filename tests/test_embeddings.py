"""Embeddings: LLM.embed / AsyncLLM.embed equal transformers' pooled hidden states; /v1/embeddings in
OpenAI's shape (floats and base64), through the openai SDK too."""

import asyncio
import base64
import json
import shutil

import numpy as np
import openai
import pytest
import torch

from asyncllm import LLM, AsyncLLM
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.server import create_app
from checkpoints import load_reference_model
from server_helpers import assert_error, request, serve_in_thread

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 200, 300], list(range(30, 70))]


def reference(model, prompt, pooling):
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("engine_kwargs", [{}, {"block_size": 4, "max_num_batched_tokens": 8}],
                         ids=["default", "chunked"])
def test_embeddings_equal_transformers(kind, engine_kwargs, model_dirs):
    """Last-token and mean pooling of the final hidden states (after the last norm), L2-normalised,
    also when the prompt is computed in chunks of 8 tokens."""
    model = load_reference_model(model_dirs[kind])
    llm = LLM(str(model_dirs[kind]), dtype="float32", **engine_kwargs)
    for pooling in ("last", "mean"):
        vectors = llm.embed(PROMPTS, pooling=pooling)
        for prompt, vector in zip(PROMPTS, vectors):
            torch.testing.assert_close(torch.tensor(vector), reference(model, prompt, pooling), rtol=1e-4, atol=1e-5)
    assert llm.stats()["kv_blocks_used"] == 0


def test_identical_inputs_identical_vectors_with_prefix_cache_and_beside_streams(model_dirs):
    async def main():
        async with AsyncLLM(str(model_dirs["llama"]), dtype="float32", block_size=4) as llm:
            text = "The quick brown fox jumps over the lazy dog."
            stream = asyncio.create_task(llm.generate("Once upon a time", max_tokens=24, ignore_eos=True))
            first = await llm.embed(text)
            again = await asyncio.gather(*(llm.embed(text) for _ in range(3)))  # the second ones hit the cache
            mean = await llm.embed(text, pooling="mean")
            generated = await stream
            return first, again, mean, generated, llm.stats()

    first, again, mean, generated, stats = asyncio.run(main())
    # equal up to float32 rounding that depends on the batch's shape (the server computes a request's
    # identical inputs once, so there they are identical to the bit: test_embeddings_route_float_and_base64)
    assert all(vector == pytest.approx(first, abs=1e-6) for vector in again) and mean != first
    assert abs(float(np.linalg.norm(first)) - 1.0) < 1e-5
    assert len(generated.outputs[0].token_ids) == 24 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0


def test_pooling_from_the_checkpoint_and_validation(model_dirs, tmp_path):
    path = tmp_path / "st-model"
    shutil.copytree(model_dirs["llama"], path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    llm = LLM(str(path), dtype="float32")
    assert llm.embed(PROMPTS[0]) == llm.embed(PROMPTS[0], pooling="mean")
    assert LLM(str(model_dirs["llama"]), dtype="float32").embed(PROMPTS[:1])[0] != llm.embed(PROMPTS[:1])[0]
    with pytest.raises(InvalidRequestError, match="pooling"):
        llm.embed(PROMPTS[0], pooling="max")


@pytest.fixture(scope="module")
def served(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    yield llm, create_app(llm)
    llm.close()


def test_embeddings_route_float_and_base64(served):
    llm, app = served
    texts = ["hello world", "hello world", "something else"]
    body = request(app, "POST", "/v1/embeddings", json={"input": texts}).json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in body["data"]]
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert len(vectors[0]) == llm.engine.runner.shape.hidden_size
    expected = asyncio.run(llm.embed("hello world"))
    assert vectors[0] == pytest.approx(expected, abs=1e-6)
    tokens = sum(len(llm.tokenizer.encode(t)) for t in texts)  # (usage counts every input, computed once or not)
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    packed = request(app, "POST", "/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(vectors[0], abs=1e-6)
    ids = request(app, "POST", "/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).json()
    assert len(ids["data"]) == 2 and ids["usage"]["prompt_tokens"] == 5


def test_embeddings_route_errors(served):
    llm, app = served
    assert_error(request(app, "POST", "/v1/embeddings", json={"input": []}), 400, "input")
    assert_error(request(app, "POST", "/v1/embeddings", json={"input": "x", "dimensions": 3}), 400, "dimensions")
    assert_error(request(app, "POST", "/v1/embeddings", json={"input": "x", "encoding_format": "int8"}), 400,
                 "encoding_format")
    assert_error(request(app, "POST", "/v1/embeddings", json={"input": [[10 ** 9]]}), 400, "input")
    assert_error(request(app, "POST", "/v1/embeddings", json={"input": "x", "model": "nope"}), 404)
    with pytest.raises(ConfigError, match="pooling"):
        create_app(llm, pooling="max")


def test_openai_sdk_embeddings_create(served):
    llm, app = served
    with serve_in_thread(app) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            result = client.embeddings.create(model=app.state.asyncllm.model_name,
                                              input=["a cat", "a dog", "a cat"])  # the SDK asks for base64
    vectors = [item.embedding for item in result.data]
    assert len(vectors) == 3 and vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert vectors[0] == pytest.approx(asyncio.run(llm.embed("a cat")), abs=1e-6)


def test_a_refused_input_aborts_the_others(model_dirs):
    """One input of a batch refused (too long): the whole request is a 400 and none of its other inputs
    keeps running in the engine."""
    import time

    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    try:
        app = create_app(llm)
        too_long = list(range(5, 5 + llm.max_model_len + 10))
        response = request(app, "POST", "/v1/embeddings", json={"input": [[5, 6, 7]] * 3 + [too_long]})
        assert_error(response, 400, "input")
        deadline = time.monotonic() + 5
        while llm.stats()["num_running"] or llm.stats()["kv_blocks_used"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        llm.close()
